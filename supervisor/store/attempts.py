"""Attempts of a run and the checkpoints they published."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from supervisor.models import (
    Attempt,
    AttemptState,
    Checkpoint,
    EventKind,
    Run,
    utcnow,
)
from supervisor.store.errors import NotFound
from supervisor.store.events import record_event


def create_attempt(
    session: Session,
    run_id: str,
    *,
    executor: str,
    job_id: str | None = None,
    resume_step: int | None = None,
    skip_ranges: list[list[int]] | None = None,
    exclude: list[str] | None = None,
    nodes: list[str] | None = None,
) -> Attempt:
    """Record the next attempt (number = current_attempt + 1) and bump the run's counter."""
    run = session.get(Run, run_id, with_for_update=True)
    if run is None:
        session.rollback()
        raise NotFound(f"run {run_id} not found")
    number = run.current_attempt + 1
    attempt = Attempt(
        run_id=run_id,
        number=number,
        executor=executor,
        job_id=job_id,
        state=AttemptState.SUBMITTED,
        resume_step=resume_step,
        skip_ranges_json=skip_ranges if skip_ranges is not None else list(run.skip_ranges_json),
        exclude_json=exclude if exclude is not None else list(run.excluded_nodes_json),
        nodes_json=nodes or [],
    )
    session.add(attempt)
    run.current_attempt = number
    run.updated_at = utcnow()
    record_event(
        session, run_id, EventKind.INFO, f"attempt {number} recorded", number, job_id=job_id
    )
    session.commit()
    return attempt


def get_attempts(session: Session, run_id: str) -> Sequence[Attempt]:
    return session.scalars(
        select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)
    ).all()


def update_attempt(session: Session, run_id: str, number: int, **fields: Any) -> None:
    """Set job_id, state, nodes_json, started_at, ended_at, exit_code, end_reason…"""
    result = session.execute(
        update(Attempt).where(Attempt.run_id == run_id, Attempt.number == number).values(**fields)
    )
    if result.rowcount != 1:
        session.rollback()
        raise NotFound(f"attempt {number} of run {run_id} not found")
    session.commit()


def record_checkpoint(
    session: Session,
    run_id: str,
    *,
    step: int,
    consumed_samples: int,
    loss: float | None,
    path: str,
    saved_at: datetime,
    complete: bool,
) -> None:
    """Insert or refresh the row for (run, step); idempotent for the level-triggered loop."""
    row = session.scalar(
        select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == step)
    )
    if row is None:
        row = Checkpoint(run_id=run_id, step=step)
        session.add(row)
    row.consumed_samples = consumed_samples
    row.loss = loss
    row.path = path
    row.saved_at = saved_at
    row.complete = complete
    session.commit()
