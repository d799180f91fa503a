"""Issue 4, integration acceptance: the watchdog on the real stack (SLURM cluster, Prometheus
discovering the workers through the supervisor, CPU Megatron-Core training, `nightwatch serve`).

Each test injects one fault through the spec's test-only `faults` section, lets the supervisor
find and cure it on its own, and checks the cure fits the cause. Detection latency (fault →
finding) and MTTR (fault → training progressing again) come from the incident rows and are
printed (`pytest -s`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from sqlalchemy import select

from supervisor.models import Checkpoint, Incident, IncidentState, Run

from .conftest import Stack, tiny_spec

pytestmark = pytest.mark.integration

BATCH = 4  # global batch: step s reads samples [4(s-1), 4s)


def _wait_nodes_idle(stack: Stack, timeout_s: float = 60) -> None:
    """Start from an idle cluster, so SLURM's node choice (lowest names first) is known."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nodes = stack.slurm.nodes()
        if nodes and all(n.idle for n in nodes.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"nodes not idle: {stack.slurm.nodes()}")


def _records(stack: Stack, run_id: str) -> tuple[Run, list[Incident], dict[int, float | None]]:
    db = stack.db()
    try:
        with db.session() as s:
            run = s.get(Run, run_id)
            incidents = s.scalars(select(Incident).where(Incident.run_id == run_id)).all()
            ckpts = s.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id)).all()
            s.expunge_all()
    finally:
        db.dispose()
    assert run is not None
    return run, list(incidents), {c.step: c.loss for c in ckpts}


def _report_timing(what: str, incident: Incident) -> tuple[float, float]:
    assert incident.fault_ts and incident.recovered_ts, incident.__dict__
    detection = (incident.detected_ts - incident.fault_ts).total_seconds()
    mttr = (incident.recovered_ts - incident.fault_ts).total_seconds()
    print(
        f"\n[watchdog real] {what}: {incident.kind} → {incident.remedy}; "
        f"detection {detection:.1f} s, MTTR {mttr:.1f} s, steps lost {incident.steps_lost}"
    )
    return detection, mttr


def _run(stack: Stack, spec: dict[str, Any], timeout_s: float = 240) -> dict[str, Any]:
    _wait_nodes_idle(stack)
    run_id = stack.api("POST", "/v1/runs", spec)["id"]
    return stack.wait_run(run_id, timeout_s)


@pytest.mark.timeout(300)
def test_poisoned_window_is_rolled_back_and_skipped(stack: Stack) -> None:
    poison = (40 * BATCH, 60 * BATCH)  # steps 41-60
    spec = tiny_spec(
        "it-poison",
        stack.data,
        model={"hidden_size": 64, "seq_length": 64},
        training={"train_steps": 90},
        checkpoint={"interval_steps": 10},
        recovery={"loss_spike_sustain_steps": 2, "rollback_skip_steps": 20},
        faults=[{"kind": "poison_data", "start_sample": poison[0], "end_sample": poison[1]}],
    )
    out = _run(stack, spec)
    assert out["state"] == "succeeded", out
    run, incidents, losses = _records(stack, out["id"])
    (incident,) = incidents
    assert incident.kind == "loss_spike" and incident.remedy == "rollback"
    assert incident.state is IncidentState.RECOVERED
    # Rolled back to a checkpoint before the onset, and the skip covers the poisoned window.
    assert run.resume_step is not None and run.resume_step * BATCH <= poison[0]
    assert any(lo <= poison[0] and hi >= poison[1] for lo, hi in run.skip_ranges_json)
    before, final = losses[run.resume_step], losses[90]
    assert before is not None and final is not None and math.isfinite(final)
    assert final < before, losses  # the curve continues the pre-fault trend
    _report_timing("poisoned data window", incident)


@pytest.mark.timeout(300)
def test_nan_on_a_bad_node_excludes_it_and_finishes_on_a_spare(stack: Stack) -> None:
    spec = tiny_spec(
        "it-badnode",
        stack.data,
        resources={"nodes": 1, "gpus_per_node": 2},
        training={"train_steps": 40},
        faults=[{"kind": "node", "node": "n1", "effect": "nan_grads", "after_step": 12}],
    )
    out = _run(stack, spec)
    assert out["state"] == "succeeded", out
    run, incidents, _ = _records(stack, out["id"])
    assert run.excluded_nodes_json == ["n1"]
    assert out["attempts"][0]["nodes"] == ["n1"]
    assert "n1" not in out["attempts"][-1]["nodes"]
    assert out["attempts"][-1]["state"] == "completed"
    cured = [i for i in incidents if i.remedy == "exclude_node"]
    assert cured and all(i.kind == "nonfinite" for i in incidents), [
        (i.kind, i.remedy) for i in incidents
    ]
    _report_timing("NaN on a bad node (first incident)", incidents[0])
    _report_timing("NaN on a bad node (exclusion)", cured[-1])
