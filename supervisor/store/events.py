"""The run's timeline: every state change, incident and action records an event."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from supervisor.models import Event, EventKind


def record_event(
    session: Session,
    run_id: str,
    kind: EventKind,
    message: str,
    attempt: int | None = None,
    **data: Any,
) -> None:
    session.add(Event(run_id=run_id, attempt=attempt, kind=kind, message=message, data_json=data))


def add_event(
    session: Session,
    run_id: str,
    kind: EventKind,
    message: str,
    *,
    attempt: int | None = None,
    data: dict[str, Any] | None = None,
) -> None:
    record_event(session, run_id, kind, message, attempt, **(data or {}))
    session.commit()


def last_checkpoint_interval(session: Session, run_id: str) -> int | None:
    """The save interval the run's newest interval event recorded (None: none yet)."""
    rows = session.scalars(
        select(Event.data_json)
        .where(Event.run_id == run_id, Event.kind == EventKind.CHECKPOINT)
        .order_by(Event.id.desc())
        .limit(200)
    )
    return next((int(d["interval_steps"]) for d in rows if d and "interval_steps" in d), None)
