"""eval_jump on plain samples: a resumed attempt's first validation loss against the one its
checkpoint recorded (`nightwatch_train_eval_resumed_loss`)."""

from __future__ import annotations

import math

import pytest
from watchdog_curves import snapshot

from contracts.spec import RecoverySpec
from supervisor.metrics_in import MetricSample, SourceHealth
from supervisor.watchdog.detectors import ALL_DETECTORS, detect_eval_jump
from supervisor.watchdog.policy import decide
from supervisor.watchdog.snapshot import FindingKind, RemedyKind, RunHistory

NAN = math.nan


def _samples(*evals: tuple[int | None, float | None], resumed: float = 4.0) -> list[MetricSample]:
    """One scrape per (eval step, eval loss), 10 steps apart, the attempt resumed at 100."""
    return [
        MetricSample(
            t=1_000.0 + 30 * i,
            step=100 + 10 * (i + 1),
            last_step_ts=1_000.0 + 30 * i,
            loss=4.0,
            eval_step=step,
            eval_loss=loss,
            eval_resumed_loss=resumed,
        )
        for i, (step, loss) in enumerate(evals)
    ]


def test_a_first_evaluation_above_the_margin_is_an_eval_jump() -> None:
    rc = RecoverySpec()  # eval_jump_ratio 0.1: above 4.4
    (finding,) = detect_eval_jump(snapshot(_samples((None, NAN), (120, 4.5))), rc)
    assert finding.kind is FindingKind.EVAL_JUMP
    assert finding.first_bad_step == 120 and finding.fault_time == 1_030.0
    assert finding.evidence == {
        "eval_loss": 4.5, "eval_step": 120, "resumed_eval_loss": 4.0, "eval_jump_ratio": 0.1,
    }  # fmt: skip
    assert "validation loss 4.5 at step 120" in finding.summary
    decided = decide(snapshot(_samples((120, 4.5))), [finding], RunHistory(), rc)
    assert decided.kind is RemedyKind.ESCALATE


@pytest.mark.parametrize(
    ("evals", "resumed", "ratio"),
    [
        (((None, NAN), (120, 4.4)), 4.0, 0.1),  # exactly at the margin
        (((120, 3.9),), 4.0, 0.1),  # the usual: lower than before
        (((120, 4.5),), 4.0, 0.2),  # within a wider margin
        (((120, 9.0),), NAN, 0.1),  # nothing recorded: a fresh run, or no eval in the ckpt
        (((None, NAN), (None, NAN)), 4.0, 0.1),  # no evaluation yet in this attempt
        (((120, 4.0), (130, 9.0)), 4.0, 0.1),  # only the attempt's first evaluation counts
    ],
)
def test_no_jump(evals: tuple, resumed: float, ratio: float) -> None:
    rc = RecoverySpec(eval_jump_ratio=ratio)
    assert detect_eval_jump(snapshot(_samples(*evals, resumed=resumed)), rc) == []


def test_a_nonfinite_first_evaluation_is_a_jump() -> None:
    (finding,) = detect_eval_jump(snapshot(_samples((120, NAN))), RecoverySpec())
    assert finding.evidence["eval_loss"] == "nan"


def test_stale_metrics_convict_nobody() -> None:
    snap = snapshot(_samples((120, 9.0)), health=SourceHealth.STALE)
    assert detect_eval_jump(snap, RecoverySpec()) == []


def test_it_runs_with_the_other_detectors() -> None:
    assert detect_eval_jump in ALL_DETECTORS
