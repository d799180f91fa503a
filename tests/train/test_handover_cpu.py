"""Training through a stop signal (`megatron_runs.handover`), two CPU ranks (gloo, DP 2),
`python -m megatron_runs.train` with `--signal-lead` (as a job submitted with
`--signal=USR2@lead`):

* `file`: USR2 at step 2; the handover file appears only once the ranks trained 5 steps past
  the signal: both ranks train on to then, save at the step they leave on (or leave on an
  interval save just before it), exit 75;
* `deadline`: a lead of 15 s and no handover file: they leave by themselves, at a step past
  the signal, saved as above;
* `at_once`: no lead: they save and leave at the signal's step, as before.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from train_helpers import spec_dict

from contracts import checkpoints, exitcodes
from worker.local_launch import LocalRun

pytestmark = pytest.mark.timeout(600)

INTERVAL = 50
PAST = 5


def _signal_at_step_2(r: LocalRun, seen: dict) -> None:
    if "signal" not in seen and 2 in r.losses():
        r.signal(signal.SIGUSR2)
        seen["signal"] = True


def _events(r: LocalRun, name: str) -> list[dict]:
    return [e for e in r.events() if e["event"] == name]


def _stops(r: LocalRun) -> list[dict]:
    return _events(r, "stopping_on_signal")


@pytest.fixture(scope="module")
def runs(run_train, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("handover")
    out: dict = {"root": root}
    ready = root / "ready"

    def spec(name: str) -> dict:
        return spec_dict(name, tp=1, pp=1, dp=2, steps=5000, interval=INTERVAL)

    seen: dict = {}

    def hand_over_later(r: LocalRun) -> None:
        _signal_at_step_2(r, seen)
        stops = _stops(r)
        if stops and "ready_at" not in seen and max(r.losses()) >= stops[0]["step"] + PAST:
            seen["ready_at"] = max(r.losses())
            ready.touch()

    extra = ["--signal-lead", "3600", "--handover-file", str(ready)]
    run = run_train(spec("file"), root / "file", extra)
    out["file_codes"] = run.wait(300, on_poll=hand_over_later)
    out["file"], out["file_seen"] = run, seen

    for name, lead in (("deadline", "15"), ("at_once", "0")):
        seen = {}
        run = run_train(spec(name), root / name, ["--signal-lead", lead])
        out[f"{name}_codes"] = run.wait(300, on_poll=lambda r, s=seen: _signal_at_step_2(r, s))
        out[name] = run
    return out


def _left_at(runs: dict, name: str) -> tuple[int, int]:
    """(the step the ranks announced the stop at, the step they left on), checking that both
    ranks exited 75 and announced it at the same step, and that the newest checkpoint, and the
    only one past the last interval save, is the one they left on (or the interval save just
    before it, where they said they left unsaved)."""
    assert runs[f"{name}_codes"] == [exitcodes.REQUEUE] * 2
    run: LocalRun = runs[name]
    (announced,) = {e["step"] for e in _stops(run)}
    left = max(run.losses())
    handovers = {(e["step"], e["resume_step"], e["saved"]) for e in _events(run, "handover")}
    resume = left
    if handovers:  # trained on, then left: rank 0 said how
        ((step, resume, saved),) = handovers
        assert step == left and saved == (resume == left)
        assert saved or resume % INTERVAL == 0
    root: Path = runs["root"] / name
    listed = [c.step for c in checkpoints.list_checkpoints(root)]
    assert listed[-1] == resume == checkpoints.read_latest(root)
    assert all(s % INTERVAL == 0 for s in listed[:-1])
    return announced, left


def test_ranks_train_on_after_a_walltime_warning_until_the_next_job_is_ready(runs) -> None:
    announced, left = _left_at(runs, "file")
    assert all(e["at_once"] is False for e in _stops(runs["file"]))
    assert left >= runs["file_seen"]["ready_at"] >= announced + PAST


def test_without_a_ready_successor_they_leave_before_the_lead_runs_out(runs) -> None:
    announced, left = _left_at(runs, "deadline")
    assert left > announced


def test_without_a_lead_they_leave_at_the_signal(runs) -> None:
    announced, left = _left_at(runs, "at_once")
    assert left == announced
    assert not _events(runs["at_once"], "handover")
    assert all(e["at_once"] is True for e in _stops(runs["at_once"]))
