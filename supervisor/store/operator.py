"""Operator requests on a run (resume, roll back): recorded here, carried out by the reconciler.

A request names the attempt it was made on and gets an id; the reconciler applies it through the
actuator keyed by that id (`Remedy.operator_request`), then clears it by compare-and-set, so a
supervisor killed in between finds the action already recorded and only clears the request.
"""

from __future__ import annotations

import secrets
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from supervisor.models import ACTIVE_RUN_STATES, Action, Checkpoint, EventKind, Run, RunState
from supervisor.store.errors import Conflict
from supervisor.store.events import record_event
from supervisor.store.runs import get_run

#: Where each request may be made.
ALLOWED_FROM = {
    "resume": frozenset({RunState.NEEDS_ATTENTION}),
    "rollback": frozenset({*ACTIVE_RUN_STATES, RunState.NEEDS_ATTENTION}),
}


def request_operator_action(
    session: Session,
    run_id: str,
    kind: str,
    by: str,
    to_step: int | None = None,
    skip_ranges: list[list[int]] | None = None,
) -> Run:
    """Record `kind` ("resume" / "rollback") for the reconciler; Conflict when the run is in
    a state that forbids it or another request is still pending."""
    run = get_run(session, run_id)
    if run.state not in ALLOWED_FROM[kind]:
        session.rollback()
        allowed = ", ".join(sorted(s.value for s in ALLOWED_FROM[kind]))
        raise Conflict(f"run {run_id} is {run.state.value}; {kind} needs it {allowed}")
    if run.cancel_requested:
        session.rollback()
        raise Conflict(f"run {run_id} is being cancelled")
    if run.operator_request_json is not None:
        session.rollback()
        pending = run.operator_request_json
        raise Conflict(f"run {run_id} has a pending {pending['kind']} by {pending['by']}")
    if to_step is not None and to_step > 0:
        steps = session.scalars(
            select(Checkpoint.step).where(Checkpoint.run_id == run_id, Checkpoint.complete)
        ).all()
        if to_step not in steps:
            session.rollback()
            have = ", ".join(str(x) for x in sorted(steps)[-10:]) or "none"
            raise Conflict(f"run {run_id} has no complete checkpoint at step {to_step} "
                           f"(newest: {have})")  # fmt: skip
    request: dict[str, Any] = {
        "id": secrets.token_hex(4),
        "kind": kind,
        "by": by,
        "attempt": run.current_attempt,
        "to_step": to_step,
        "skip_ranges": skip_ranges or [],
    }
    session.execute(update(Run).where(Run.id == run_id).values(operator_request_json=request))
    record_event(session, run_id, EventKind.INFO, f"{kind} requested by {by}",
                 run.current_attempt, request=request)  # fmt: skip
    session.commit()
    session.refresh(run)
    return run


def operator_action_recorded(session: Session, run_id: str, request_id: str) -> bool:
    """Whether the actuator already recorded the action that carries out this request."""
    return (
        session.scalar(
            select(Action.key).where(
                Action.run_id == run_id, Action.target == f"operator:{request_id}"
            )
        )
        is not None
    )


def clear_operator_request(session: Session, run_id: str, request_id: str) -> None:
    """Done with it (compare-and-set on its id: a newer request stays)."""
    rows = session.scalars(select(Run).where(Run.id == run_id)).all()
    if rows and (rows[0].operator_request_json or {}).get("id") == request_id:
        session.execute(update(Run).where(Run.id == run_id).values(operator_request_json=None))
    session.commit()
