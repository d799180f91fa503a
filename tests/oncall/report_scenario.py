"""A recorded overnight run, as rows: a poisoned data window caught as a loss spike, rolled
back to step 30 with the bad samples skipped, then finished. Shared by the report tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from supervisor.metrics_in import LossPoint
from supervisor.report import ReportData

T0 = datetime(2026, 11, 26, 1, 0, 0, tzinfo=UTC)
STEP_S = 2.0
GBS = 8
RESTART_GAP_S = 20.0


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def healthy_loss(step: int) -> float:
    return 8.0 / (1 + 0.05 * step)


def scenario(*, steps_lost_recorded: bool = True, finished: bool = True) -> ReportData:
    # attempt 1: steps 1..43 (spike from 41), detected after step 43, cancelled
    a1_end = 43 * STEP_S + 5
    a2_start = a1_end + RESTART_GAP_S
    loss = [
        LossPoint(s, healthy_loss(s) * (6 if s >= 41 else 1), 1, at(s * STEP_S).timestamp())
        for s in range(1, 44)
    ]
    # attempt 2: resumes at 30 with samples [320, 352) skipped, healthy to 60
    loss += [
        LossPoint(s, healthy_loss(s), 2, at(a2_start + (s - 30) * STEP_S).timestamp())
        for s in range(31, 61)
    ]
    a2_end = a2_start + 30 * STEP_S + 3
    attempts: list[dict[str, Any]] = [
        {"number": 1, "job_id": "101", "state": "cancelled", "started_at": T0,
         "ended_at": at(a1_end), "end_reason": "rollback", "resume_step": None,
         "skip_ranges": [], "exclude": [], "nodes": ["n1", "n2"]},
        {"number": 2, "job_id": "102", "state": "completed" if finished else "running",
         "started_at": at(a2_start), "ended_at": at(a2_end) if finished else None,
         "resume_step": 30, "skip_ranges": [[320, 352]], "exclude": [], "nodes": ["n1", "n3"]},
    ]  # fmt: skip
    incidents = [
        {"id": 1, "attempt": 1, "kind": "loss_spike", "fault_ts": at(40 * STEP_S),
         "detected_ts": at(43 * STEP_S + 1), "recovered_ts": at(a2_start + 4 * STEP_S),
         "remedy": "rollback", "steps_lost": 13 if steps_lost_recorded else None,
         "state": "recovered",
         "evidence": {"last_healthy_step": 40, "first_bad_step": 41, "sample_window": [320, 344]}},
    ]  # fmt: skip
    actions = [
        {"attempt": 1, "kind": "rollback", "target": "step 30 skip [320, 352)", "state": "done",
         "created_at": at(43 * STEP_S + 2), "finished_at": at(a1_end)},
    ]  # fmt: skip
    checkpoints = [
        {"step": s, "loss": healthy_loss(s), "saved_at": at(s * STEP_S + 0.5), "complete": True}
        for s in (10, 20, 30, 40)
    ]
    run = {
        "id": "r-0ca11ed0beef", "name": "tiny-cpu", "state": "succeeded" if finished else "running",
        "state_reason": "reached train_steps" if finished else None, "target_steps": 60,
        "last_step": 60 if finished else 45, "skip_ranges": [[320, 352]],
        "excluded_nodes": ["n2"],
    }  # fmt: skip
    return ReportData(
        run=run,
        attempts=attempts,
        incidents=incidents,
        actions=actions,
        checkpoints=checkpoints,
        loss=loss,
        global_batch_size=GBS,
        now=(T0 + timedelta(hours=3)).timestamp(),
    )
