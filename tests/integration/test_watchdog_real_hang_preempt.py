"""Issue 4, integration acceptance: a hang and a preemption on the real stack (SLURM cluster,
Prometheus, CPU Megatron-Core training, `nightwatch serve`), cured by the watchdog alone.

Same style as `test_watchdog_real`: one injected fault per test, the cure must fit the cause,
detection latency and MTTR come from the incident rows and are printed (`pytest -s`). The
trainer's own JSON log lines (rank 0, per attempt) say where each attempt started and stopped,
which is what "steps lost" is judged on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from contracts.checkpoints import list_checkpoints
from supervisor.models import Action
from supervisor.watchdog.snapshot import RemedyKind

from .conftest import Stack, tiny_spec
from .test_watchdog_real import (
    _records,
    _report_timing,
    _run,
    _submit_until_excluded,
    _wait_nodes_idle,
)

pytestmark = pytest.mark.integration

HANG_FLOOR_S = 10.0
HANG_STEP = 13  # both ranks on n1 stop at the start of this step; checkpoints at 5 and 10
#: Remedies that change the job (OBSERVE only notifies; NONE does nothing).
_ACTING = {k.value for k in RemedyKind} - {RemedyKind.OBSERVE.value, RemedyKind.NONE.value}


def _events(stack: Stack, run_id: str) -> list[tuple[Any, ...]]:
    """The run's timeline, for assertion messages."""
    items = stack.api("GET", f"/v1/runs/{run_id}/events?limit=1000")["items"]
    return [(e["attempt"], e["kind"], e["message"], e["data"]) for e in items]


def _train_log(stack: Stack, run_id: str, attempt: int) -> list[dict[str, Any]]:
    """Rank 0's JSON events of one attempt (from every file SLURM wrote for its job)."""
    out = []
    for path in sorted((stack.home / "runs" / run_id / "logs" / f"a{attempt}").rglob("*.out")):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith('{"ts"'):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by the kill
    return [e for e in out if e.get("rank") == 0]


def _steps(log: list[dict[str, Any]], event: str) -> list[int]:
    return [int(e["step"]) for e in log if e.get("event") == event]


def _remedies(stack: Stack, run_id: str) -> list[str]:
    """Remedies the watchdog carried out (action rows), in order."""
    db = stack.db()
    try:
        with db.session() as s:
            rows = select(Action.kind).where(Action.run_id == run_id).order_by(Action.id)
            return [k for k in s.scalars(rows) if k in _ACTING]
    finally:
        db.dispose()


def _remedy_outcomes(stack: Stack, run_id: str) -> list[dict[str, Any]]:
    """The recorded outcomes of the remedies the watchdog carried out, in order."""
    db = stack.db()
    try:
        with db.session() as s:
            rows = select(Action).where(Action.run_id == run_id).order_by(Action.id)
            return [a.result_json or {} for a in s.scalars(rows) if a.kind in _ACTING]
    finally:
        db.dispose()


def _hang_spec(stack: Stack) -> dict[str, Any]:
    """Long enough after the restart for Prometheus to see the new attempt train (MTTR)."""
    return tiny_spec(
        "it-hang",
        stack.data,
        resources={"device": "cpu", "nodes": 1, "gpus_per_node": 2},
        training={"train_steps": 200},
        recovery={"hang_floor_seconds": HANG_FLOOR_S},
        faults=[{"kind": "node", "node": "n1", "effect": "hang", "after_step": HANG_STEP}],
    )


def _check_hang_cured(stack: Stack, out: dict[str, Any]) -> None:
    """Every attempt but the last hung on n1 and was restarted, or (after a recurrence) n1 was
    excluded; each hang was detected past the floor, and at most the steps since checkpoint 10
    were lost."""
    run_id = out["id"]
    events = _events(stack, run_id)
    assert out["state"] == "succeeded", (out, events)
    run, incidents, _ = _records(stack, run_id)
    attempts = out["attempts"]
    nodes = [a["nodes"] for a in attempts]
    assert all(n == ["n1"] for n in nodes[:-1]) and "n1" not in nodes[-1], (nodes, events)
    assert attempts[-1]["state"] == "completed", (attempts, events)
    recurred = len(attempts) == 3
    expected = ["restart", "exclude_node"] if recurred else ["restart"]
    assert len(attempts) in (2, 3), (nodes, events)
    assert [(i.kind, i.remedy) for i in incidents] == [("hang", r) for r in expected], events
    assert _remedies(stack, run_id) == expected, events
    assert run.excluded_nodes_json == (["n1"] if recurred else []), events
    for incident in incidents:
        detection = (incident.detected_ts - incident.fault_ts).total_seconds()
        # Not before the floor (no false alarm on slow steps), and not long after it.
        assert HANG_FLOOR_S <= detection <= HANG_FLOOR_S + 30, (detection, incident.__dict__)
        assert incident.evidence_json["last_healthy_step"] == HANG_STEP - 1, incident.__dict__
        assert incident.steps_lost == HANG_STEP - 1 - 10, incident.__dict__
    for number in range(1, len(attempts) + 1):
        log = _train_log(stack, run_id, number)
        # Each attempt after the first resumes from the newest checkpoint before the hang.
        assert _steps(log, "train_start") == [0 if number == 1 else 10], (number, log[-5:])
        if number < len(attempts):
            assert max(_steps(log, "step")) == HANG_STEP - 1, (number, log[-5:])
    _report_timing("hang on n1 (restart)", incidents[0])
    if recurred:
        _report_timing("hang recurred on n1 (exclusion)", incidents[1])


@pytest.mark.timeout(300)
def test_hang_is_detected_and_restarted(stack: Stack) -> None:
    """Both ranks on n1 hang from step 13 on. The hang detector must fire after the lowered
    floor and the first remedy must be a restart from checkpoint 10. The restart's job lands
    on a node idle at that moment: n2 while n1 still kills the hung ranks (the run finishes
    there), or n1 again, where the hang recurs and the policy excludes n1 (the run finishes on
    another node)."""
    _check_hang_cured(stack, _run(stack, _hang_spec(stack), timeout_s=240))


@pytest.mark.timeout(300)
def test_hang_that_recurs_on_its_node_excludes_the_node(stack: Stack) -> None:
    """The same hang while a blocker job holds n2 and n3, so the restart can only land on n1
    again: the hang recurs there, the policy excludes n1, and the run finishes on n2 or n3
    (whichever SLURM picks) once the blocker is gone (both remedies resume from checkpoint
    10)."""
    run_id = _submit_until_excluded(stack, _hang_spec(stack), "n1", blocked="n2,n3", timeout_s=150)
    out = stack.wait_run(run_id, 120)
    nodes = [a["nodes"] for a in out["attempts"]]
    assert nodes[:2] == [["n1"], ["n1"]] and nodes[2:] in ([["n2"]], [["n3"]]), out["attempts"]
    _check_hang_cured(stack, out)


def _wait_checkpoint(root: Path, step: int, timeout_s: float) -> int:
    """Newest complete checkpoint once one at `step` or later is on disk."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [c.step for c in list_checkpoints(root) if c.complete]
        if done and max(done) >= step:
            return max(done)
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at step {step} or later in {root} after {timeout_s}s")


@pytest.mark.timeout(300)
def test_preemption_is_requeued_and_resumes_from_the_signal_checkpoint(stack: Stack) -> None:
    """SIGUSR2 to the job (SLURM's walltime warning) once step 10 is saved: the trainer
    announces the stop, trains on while the watchdog prepares the next attempt's standby job,
    and once that job's nodes are ready saves and exits 75; the watchdog must requeue
    (nobody's fault: no restart, rollback or exclusion) into the standby job, and the new
    attempt resume from exactly that checkpoint, so no step beyond it is lost."""
    steps, interval = 400, 10
    # One node (two ranks on it): the standby job fits beside it on this 3-node cluster.
    spec = tiny_spec(
        "it-preempt",
        stack.data,
        resources={"nodes": 1, "gpus_per_node": 2},
        training={"train_steps": steps},
        checkpoint={"interval_steps": interval, "keep_last": 100},
    )
    _wait_nodes_idle(stack)
    run_id = stack.api("POST", "/v1/runs", spec)["id"]
    root = stack.home / "runs" / run_id / "checkpoints"
    seen = _wait_checkpoint(root, interval, timeout_s=120)
    (first,) = stack.api("GET", f"/v1/runs/{run_id}")["attempts"]
    signalled = time.time()
    stack.slurm.signal(first["job_id"], "USR2")
    out = stack.wait_run(run_id, 240)
    events = _events(stack, run_id)
    assert out["state"] == "succeeded", (out, events)
    run, incidents, losses = _records(stack, run_id)
    assert len(out["attempts"]) == 2, (out["attempts"], events)
    a1, a2 = out["attempts"]
    assert a1["exit_code"] == 75 and a1["state"] == "preempted", (out["attempts"], events)
    assert a2["state"] == "completed", (out["attempts"], events)
    assert _remedies(stack, run_id) == ["requeue"], events
    (incident,) = incidents
    # SLURM says FAILED 75 (or PREEMPTED for its own preemption): either way, infrastructure.
    assert incident.kind in ("job_failed", "job_preempted"), incident.__dict__
    assert incident.remedy == "requeue" and incident.evidence_json["cause"] == "infra", events
    assert run.excluded_nodes_json == [] and run.skip_ranges_json == [], events
    log1, log2 = _train_log(stack, run_id, 1), _train_log(stack, run_id, 2)
    (announced,) = _steps(log1, "stopping_on_signal")
    (left,) = _steps(log1, "handover")
    stopped = max(_steps(log1, "checkpoint_saved"))
    # Attempt 1 left at or after the step it announced the stop at, on a save there or on the
    # interval save just before it (fewer steps to train again than a save costs).
    assert seen < announced <= left < steps and stopped in (left, left - left % interval), log1[-5:]
    # It trained on until the standby job was ready: attempt 2 runs there, not in a new sbatch.
    assert a2["job_id"] != a1["job_id"], out["attempts"]
    assert [e["in_job"] for e in _remedy_outcomes(stack, run_id)] == [True], events
    assert stopped in losses, sorted(losses)
    # Attempt 2 resumed from exactly that checkpoint: nothing beyond it was lost.
    assert _steps(log2, "train_start") == [stopped], (log2[:5], events)
    assert incident.steps_lost <= left - stopped, incident.__dict__
    _report_timing("preemption (USR2)", incident)
    print(
        f"[watchdog real] preemption: signal → requeue decided "
        f"{incident.detected_ts.timestamp() - signalled:.1f} s, resumed at step {stopped}"
    )
