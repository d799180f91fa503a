"""The overnight report of one run: `GET /v1/runs/{run_id}/report`.

Reads the run's rows, turns them into plain dicts and lets the pure `supervisor.report` do the
arithmetic. The loss curve comes from `app.state.loss_history` when the app has one (a
callable `run_id -> list[LossPoint]`, e.g. a Prometheus range query joined by
`supervisor.metrics_in.promql.loss_from_matrix`), else from the trainer's own step lines in
the run's logs (`supervisor.run_logs.loss_points`); the checkpoints' losses are added to both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi import Path as PathParam
from sqlalchemy import select
from sqlalchemy.orm import Session

from supervisor import store
from supervisor.api.deps import ReadToken, SessionDep
from supervisor.api.routes.runs import ERRORS, NOT_FOUND
from supervisor.api.schemas import RUN_ID_PATTERN
from supervisor.models import Action, Checkpoint, Incident, Run
from supervisor.report import (
    LossPoint,
    Report,
    ReportData,
    build_report,
    loss_from_checkpoints,
)
from supervisor.run_logs import loss_points

router = APIRouter(prefix="/v1/runs", tags=["report"], responses=ERRORS)

RunId = Annotated[str, PathParam(pattern=RUN_ID_PATTERN, examples=["r-3f9a0c12d4e5"])]
LossHistory = Callable[[str], Sequence[LossPoint]]


def get_loss_history(request: Request) -> LossHistory | None:
    return getattr(request.app.state, "loss_history", None)


def _run_row(run: Run) -> dict[str, Any]:
    return {
        "id": run.id,
        "name": run.name,
        "state": run.state.value,
        "state_reason": run.state_reason,
        "target_steps": run.target_steps,
        "last_step": run.last_step,
        "skip_ranges": list(run.skip_ranges_json or []),
        "excluded_nodes": list(run.excluded_nodes_json or []),
    }


def report_data(
    session: Session,
    run_id: str,
    history: LossHistory | None,
    now: float,
    home: Path | None = None,
) -> ReportData:
    """The rows of one run as the plain data `build_report` takes. The loss curve: `history`
    (Prometheus) when there is one, else the trainer's step lines under `home`."""
    run = store.get_run(session, run_id)
    attempts = [
        {
            "number": a.number,
            "job_id": a.job_id,
            "state": a.state.value,
            "submitted_at": a.submitted_at,
            "started_at": a.started_at,
            "ended_at": a.ended_at,
            "exit_code": a.exit_code,
            "end_reason": a.end_reason,
            "resume_step": a.resume_step,
            "skip_ranges": a.skip_ranges_json,
            "exclude": a.exclude_json,
            "nodes": a.nodes_json,
        }
        for a in store.get_attempts(session, run_id)
    ]
    incidents = [
        {
            "id": i.id,
            "attempt": i.attempt,
            "kind": i.kind,
            "fault_ts": i.fault_ts,
            "detected_ts": i.detected_ts,
            "recovered_ts": i.recovered_ts,
            "remedy": i.remedy,
            "steps_lost": i.steps_lost,
            "state": i.state.value,
            "evidence": i.evidence_json,
        }
        for i in session.scalars(
            select(Incident).where(Incident.run_id == run_id).order_by(Incident.id)
        )
    ]
    actions = [
        {
            "attempt": a.attempt,
            "kind": a.kind,
            "target": a.target,
            "state": a.state.value,
            "created_at": a.created_at,
            "finished_at": a.finished_at,
        }
        for a in session.scalars(select(Action).where(Action.run_id == run_id).order_by(Action.id))
    ]
    checkpoints = [
        {"step": c.step, "loss": c.loss, "saved_at": c.saved_at, "complete": c.complete}
        for c in session.scalars(
            select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step)
        )
    ]
    if history is not None:
        loss = list(history(run_id))
    elif home is not None:
        loss = loss_points(home, run_id, attempts)
    else:
        loss = []
    loss += loss_from_checkpoints(checkpoints)
    evals = loss_points(home, run_id, attempts, event="eval") if home is not None else []
    training = (run.spec_json or {}).get("training", {})
    return ReportData(
        run=_run_row(run),
        attempts=attempts,
        incidents=incidents,
        actions=actions,
        checkpoints=checkpoints,
        loss=loss,
        eval_loss=evals,
        global_batch_size=int(training.get("global_batch_size", 1)),
        now=now,
    )


@router.get("/{run_id}/report", response_model=Report, responses=NOT_FOUND)
def run_report(
    run_id: RunId,
    session: SessionDep,
    _: ReadToken,
    history: Annotated[LossHistory | None, Depends(get_loss_history)],
    request: Request,
) -> dict[str, Any]:
    """What happened to the run: timeline, incidents, downtime, steps lost, ETTR, loss curve."""
    home = request.app.state.settings.home
    return build_report(report_data(session, run_id, history, time.time(), home)).to_dict()
