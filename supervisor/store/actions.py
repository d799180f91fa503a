"""The watchdog's actions (intent before effect, keyed so a replay is a no-op),
incidents and node health."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from supervisor.models import (
    Action,
    ActionState,
    EventKind,
    Incident,
    IncidentState,
    Node,
    NodeHealth,
    utcnow,
)
from supervisor.store.errors import NotFound
from supervisor.store.events import record_event


def action_key(run_id: str, attempt: int | None, kind: str, target: str) -> str:
    return f"{run_id}|{attempt}|{kind}|{target}"


def begin_action(
    session: Session,
    run_id: str,
    attempt: int | None,
    kind: str,
    target: str,
    evidence: dict[str, Any],
    *,
    fence: Callable[[Session], None] | None = None,
) -> Action | None:
    """Write the intent before acting; None when this action was already taken (replay).

    `fence` runs first in the same transaction (the lease check, which raises when this
    replica may no longer act), so no intent is ever recorded by a deposed actor."""
    key = action_key(run_id, attempt, kind, target)
    if fence is not None:
        fence(session)
    action = Action(
        key=key,
        run_id=run_id,
        attempt=attempt,
        kind=kind,
        target=target,
        state=ActionState.INTENT,
        evidence_json=evidence,
        result_json={},
    )
    session.add(action)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        return None
    record_event(session, run_id, EventKind.ACTION_INTENT, f"{kind} {target}", attempt, **evidence)
    session.commit()
    return action


def finish_action(session: Session, key: str, *, ok: bool, result: dict[str, Any]) -> None:
    action = session.scalar(select(Action).where(Action.key == key))
    if action is None:
        raise NotFound(f"action {key} not found")
    action.state = ActionState.DONE if ok else ActionState.FAILED
    action.result_json = result
    action.finished_at = utcnow()
    outcome = "done" if ok else "failed"
    record_event(
        session,
        action.run_id,
        EventKind.ACTION_OUTCOME,
        f"{action.kind} {action.target}: {outcome}",
        action.attempt,
        **result,
    )
    session.commit()


def abandon_actions(session: Session, run_id: str, reason: str) -> list[str]:
    """Finish every unfinished action of a run that ended (cancelled): none of them may be
    resumed any more. Each gets its outcome event; returns their keys."""
    keys = list(
        session.scalars(
            select(Action.key).where(Action.run_id == run_id, Action.state == ActionState.INTENT)
        )
    )
    for key in keys:
        finish_action(session, key, ok=False, result={"abandoned": reason})
    return keys


def open_incident(
    session: Session,
    run_id: str,
    attempt: int | None,
    kind: str,
    *,
    evidence: dict[str, Any],
    fault_ts: datetime | None = None,
) -> Incident:
    incident = Incident(
        run_id=run_id,
        attempt=attempt,
        kind=kind,
        fault_ts=fault_ts,
        state=IncidentState.OPEN,
        evidence_json=evidence,
    )
    session.add(incident)
    session.flush()
    record_event(
        session,
        run_id,
        EventKind.INCIDENT,
        f"incident: {kind}",
        attempt,
        incident_id=incident.id,
        **evidence,
    )
    session.commit()
    return incident


def recorded_incident_keys(session: Session, run_id: str, kinds: Sequence[str]) -> set[str]:
    """The trainer records (`evidence.record`) the run's incidents of `kinds` were made from."""
    rows = session.scalars(
        select(Incident.evidence_json).where(Incident.run_id == run_id, Incident.kind.in_(kinds))
    )
    return {str(ev["record"]) for ev in rows if ev and ev.get("record")}


def incident_counts(session: Session, run_ids: Sequence[str]) -> dict[tuple[str, str], int]:
    """(run id, kind) → incidents, for the given runs that had any (one grouped query)."""
    if not run_ids:
        return {}
    rows = session.execute(
        select(Incident.run_id, Incident.kind, func.count())
        .where(Incident.run_id.in_(run_ids))
        .group_by(Incident.run_id, Incident.kind)
    )
    return {(run_id, kind): int(n) for run_id, kind, n in rows}


def update_incident(session: Session, incident_id: int, **fields: Any) -> None:
    """Set remedy, state, recovered_ts, steps_lost…"""
    if not session.execute(
        update(Incident).where(Incident.id == incident_id).values(**fields)
    ).rowcount:
        session.rollback()
        raise NotFound(f"incident {incident_id} not found")
    session.commit()


def set_node_health(
    session: Session, name: str, health: NodeHealth, reason: str, *, strike: bool = False
) -> Node:
    node = session.get(Node, name)
    if node is None:
        node = Node(name=name, strikes=0)
        session.add(node)
    node.health = health
    node.reason = reason
    node.strikes = (node.strikes or 0) + (1 if strike else 0)
    node.updated_at = utcnow()
    session.commit()
    return node
