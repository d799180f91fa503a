"""TrainMetrics: contract names, window gauges that keep a bad step visible, node vs run."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from contracts.metric_names import metric_names
from megatron_runs.metrics import StepReport, TrainMetrics

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "contracts.md"


def _values(m: TrainMetrics) -> dict[str, float]:
    text = generate_latest(m.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                assert s.labels == {"run_id": "r1", "attempt": "2", "node": "n1"}
                out[s.name] = s.value
    return out


def _report(step: int, loss: float, norm: float = 1.0, skipped: int = 0) -> StepReport:
    return StepReport(
        step=step,
        loss=loss,
        grad_norm=norm,
        lr=1e-3,
        tokens=512,
        samples_consumed=8 * step,
        skipped=skipped,
        step_time=0.5,
        node_step_time=0.4,
        mfu=0.0,
    )


def test_names_match_the_contract_table() -> None:
    contract = {
        line.split("`")[1]
        for line in CONTRACT.read_text().splitlines()
        if line.startswith("| `nightwatch_train_")
    }
    assert set(metric_names()) == contract
    m = TrainMetrics("r1", 2, "n1", run_level=True)
    m.on_step(_report(1, 3.0))
    assert set(_values(m)) == contract


def test_window_keeps_a_spike_and_nan_visible_between_scrapes() -> None:
    m = TrainMetrics("r1", 2, "n1", run_level=True)
    for step, loss in enumerate([3.0, 3.0, 30.0, 3.0, 2.9], start=1):
        m.on_step(_report(step, loss, norm=50.0 if step == 3 else 1.0))
    v = _values(m)
    assert v["nightwatch_train_loss"] == 2.9
    assert v["nightwatch_train_loss_window_max"] == 30.0
    assert v["nightwatch_train_loss_window_min"] == 2.9
    assert v["nightwatch_train_grad_norm_window_max"] == 50.0
    assert v["nightwatch_train_loss_summed_total"] == 41.9
    m.on_step(_report(6, math.nan, norm=math.nan))
    v = _values(m)
    assert v["nightwatch_train_nonfinite_steps_total"] == 1
    assert v["nightwatch_train_loss_window_max"] == 30.0  # NaN does not hide the spike
    assert v["nightwatch_train_loss_summed_total"] == 41.9
    for step in range(7, 7 + 16):
        m.on_step(_report(step, 2.0))
    assert _values(m)["nightwatch_train_loss_window_max"] == 2.0  # spike left the window


def test_counters_checkpoints_and_replicas() -> None:
    m = TrainMetrics("r1", 2, "n1", run_level=True)
    m.start(target_steps=100, step=40, samples_consumed=320)
    m.on_step(_report(41, 2.0, skipped=8))
    m.on_checkpoint(41, 1.5, ok=True)
    m.on_checkpoint(42, 0.1, ok=False)
    m.on_replica_check(False)
    m.on_replica_check(True)
    v = _values(m)
    assert v["nightwatch_train_step"] == 41 and v["nightwatch_train_target_steps"] == 100
    assert v["nightwatch_train_skipped_samples_total"] == 8
    assert v["nightwatch_train_tokens_total"] == 512
    assert v["nightwatch_train_tokens_per_second"] == 1024
    assert v["nightwatch_train_checkpoint_step"] == 41
    assert v["nightwatch_train_checkpoint_duration_seconds"] == 1.5
    assert v["nightwatch_train_checkpoint_failures_total"] == 1
    assert v["nightwatch_train_replica_checks_total"] == 2
    assert v["nightwatch_train_replica_mismatches_total"] == 1


def test_other_nodes_export_only_node_series() -> None:
    m = TrainMetrics("r1", 2, "n1", run_level=False)
    m.set_up(True)
    m.on_step(_report(5, 2.0))
    v = _values(m)
    assert set(v) == set(metric_names(run_level=False))
    assert v["nightwatch_train_step_time_seconds"] == 0.4
    assert v["nightwatch_train_up"] == 1
    assert v["nightwatch_train_nonfinite_grads_total"] == 0
    m.on_step(dataclasses.replace(_report(6, 2.0), local_grads_finite=False))
    assert _values(m)["nightwatch_train_nonfinite_grads_total"] == 1


def test_step_entered_leads_the_completed_step_while_a_step_runs() -> None:
    m = TrainMetrics("r1", 2, "n1", run_level=False)
    m.start(100, 40, 0)  # resumed at step 40: nothing begun yet
    assert _values(m)["nightwatch_train_step_entered"] == 40
    m.on_step_entered(41)
    v = _values(m)
    assert (v["nightwatch_train_step_entered"], v["nightwatch_train_step"]) == (41, 40)
    m.on_step(_report(41, 2.0))
    assert _values(m)["nightwatch_train_step"] == 41


def test_endpoint_serves_on_loopback_ephemeral_port() -> None:
    import urllib.request

    m = TrainMetrics("r1", 2, "n1", run_level=True)
    port = m.serve("127.0.0.1", 0)
    m.on_step(_report(1, 2.0))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'nightwatch_train_step{attempt="2",node="n1",run_id="r1"} 1.0' in body


def test_eval_gauges_start_unset_then_carry_the_last_evaluation() -> None:
    m = TrainMetrics("r1", 2, "n1", run_level=True)
    m.on_resumed_eval((40, 5.25))  # the resumed checkpoint's newest evaluation
    v = _values(m)
    assert v["nightwatch_train_eval_resumed_loss"] == 5.25
    assert math.isnan(v["nightwatch_train_eval_loss"]) and math.isnan(
        v["nightwatch_train_eval_step"]
    )
    m.on_eval(60, 5.0)
    v = _values(m)
    assert (v["nightwatch_train_eval_step"], v["nightwatch_train_eval_loss"]) == (60, 5.0)
    fresh = TrainMetrics("r1", 2, "n1", run_level=True)
    fresh.on_resumed_eval(None)
    assert math.isnan(_values(fresh)["nightwatch_train_eval_resumed_loss"])
    node = TrainMetrics("r1", 2, "n1", run_level=False)
    node.on_resumed_eval((40, 5.25))
    node.on_eval(60, 5.0)
    assert set(_values(node)) == set(metric_names(run_level=False))


def test_the_longest_gap_between_steps_is_kept_from_the_second_step() -> None:
    """A save or a stall between two steps widens the gap the hang limit must stay above;
    the start-up before the first step is not such a gap."""
    clock = iter([100.0, 100.25, 103.25, 103.5]).__next__
    m = TrainMetrics("r1", 2, "n1", run_level=False, monotonic=clock)
    gap = "nightwatch_train_step_gap_max_seconds"
    m.on_step(_report(1, 3.0))
    assert _values(m)[gap] == 0.0
    m.on_step(_report(2, 3.0))
    assert _values(m)[gap] == 0.25
    m.on_step(_report(3, 3.0))  # a 3 s save before it
    m.on_step(_report(4, 3.0))
    assert _values(m)[gap] == 3.0
