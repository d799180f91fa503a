"""Nodes as the supervisor knows them, and an operator's exclude / restore of one.

A node is known once Nightwatch has met it: a row in `nodes` (SLURM lists it, a remedy struck
it, or an operator acted on it), an attempt that ran there, or a run that excludes it. The API
records an operator's request as a `node_actions` intent with the node's state as its evidence;
the reconciler carries it out and finishes it in the transaction that changes the node, so the
request is never lost nor applied twice (`supervisor.watchdog.actions.Actuator.node_action`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from supervisor.models import (
    TERMINAL_RUN_STATES,
    Action,
    ActionState,
    Attempt,
    EventKind,
    Node,
    NodeAction,
    NodeActionKind,
    NodeHealth,
    Run,
)
from supervisor.store.errors import Conflict, NotFound
from supervisor.store.events import record_event

#: The watchdog's action kind that strikes and excludes a node (ActionKind.EXCLUDE_NODE).
EXCLUDE_NODE_ACTION = "exclude_node"


def fleet_excluded_nodes(session: Session) -> set[str]:
    """Nodes an operator excluded: every run's next submission avoids them."""
    return set(session.scalars(select(Node.name).where(Node.excluded)))


def node_names(session: Session) -> set[str]:
    return set(session.scalars(select(Node.name)))


def add_nodes(session: Session, names: Iterable[str]) -> None:
    """Rows for nodes the cluster lists (healthy, no strike); a known name is left as it is."""
    known = node_names(session)
    session.add_all(Node(name=n, health=NodeHealth.HEALTHY, strikes=0) for n in names
                    if n not in known)  # fmt: skip
    session.commit()


def list_nodes(session: Session) -> list[dict[str, Any]]:
    """Every known node, by name, with its health, strikes, exclusions and indictments."""
    rows = {n.name: n for n in session.scalars(select(Node))}
    attempt_nodes = session.scalars(select(Attempt.nodes_json)).all()
    live_runs = _live_runs(session)
    names = set(rows)
    names.update(n for nodes in attempt_nodes for n in nodes or ())
    names.update(n for r in live_runs for n in r.excluded_nodes_json or ())
    indictments = _indictments(session)
    pending = {a.node: a for a in _pending(session)}
    return [
        _view(name, rows.get(name), live_runs, indictments.get(name, []), pending.get(name))
        for name in sorted(names)
    ]


def get_node(session: Session, name: str) -> dict[str, Any]:
    """One known node with its operator actions, newest first; NotFound for a stranger."""
    for node in list_nodes(session):
        if node["name"] == name:
            actions = session.scalars(
                select(NodeAction).where(NodeAction.node == name).order_by(NodeAction.id.desc())
            )
            return {**node, "actions": [node_action_view(a) for a in actions]}
    raise NotFound(f"node {name} is not known to this supervisor (SLURM does not list it, no "
                   "job ran there, no run excludes it)")  # fmt: skip


def request_node_action(
    session: Session, name: str, kind: NodeActionKind, by: str, reason: str
) -> dict[str, Any]:
    """Record an operator's exclude / restore of `name` for the reconciler (intent, with the
    node as it stands as evidence). NotFound for an unknown node; Conflict when it is already
    excluded (restored), or another request on it is pending."""
    node = get_node(session, name)
    refusal = _refusal(node, kind)
    if refusal is not None:
        session.rollback()
        raise Conflict(f"node {name} {refusal}")
    count = session.scalar(
        select(func.count()).select_from(NodeAction).where(NodeAction.node == name)
    )
    evidence = {k: v for k, v in node.items() if k not in ("actions", "pending")}
    action = NodeAction(  # two requests racing share the key: the second is refused
        key=f"node|{name}|{(count or 0) + 1}",
        node=name,
        kind=kind,
        state=ActionState.INTENT,
        requested_by=by,
        reason=reason,
        evidence_json=evidence,
        result_json={},
    )
    session.add(action)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"node {name} has another request in flight") from None
    return get_node(session, name)


def pending_node_actions(session: Session) -> list[NodeAction]:
    return _pending(session)


def finish_node_action(
    session: Session,
    key: str,
    now: datetime,
    *,
    fence: Callable[[Session], None] | None = None,
    **result: Any,
) -> NodeAction | None:
    """Apply the request `key` to the node and record its outcome, in one transaction (run
    `fence`, the lease check, first); None when it is no longer pending (already finished).

    Exclude: the whole fleet avoids the node from the next submission on. Restore: the node is
    healthy (its strikes stay: they are history) and no longer excluded, neither by the fleet
    nor by the runs still going that the watchdog had excluded it from (a spec's own
    `resources.exclude` stays); each such run's timeline says so."""
    if fence is not None:
        fence(session)
    action = session.scalar(
        select(NodeAction).where(NodeAction.key == key, NodeAction.state == ActionState.INTENT)
    )
    if action is None:
        session.rollback()
        return None
    node = session.get(Node, action.node) or Node(name=action.node, strikes=0)
    session.add(node)
    note = f"{action.kind.value} by {action.requested_by}" + (
        f": {action.reason}" if action.reason else ""
    )
    if action.kind is NodeActionKind.EXCLUDE:
        node.excluded, node.excluded_by, node.excluded_at = True, action.requested_by, now
        node.health = NodeHealth.EXCLUDED
    else:
        node.excluded, node.excluded_by, node.excluded_at = False, None, None
        node.health = NodeHealth.HEALTHY
        result["runs"] = _unexclude_from_runs(session, action.node, note)
    node.reason, node.updated_at = note, now
    action.state, action.result_json, action.finished_at = ActionState.DONE, result, now
    session.commit()
    return action


def node_action_view(a: NodeAction) -> dict[str, Any]:
    return {
        "id": a.id,
        "kind": a.kind.value,
        "state": a.state.value,
        "requested_by": a.requested_by,
        "reason": a.reason,
        "requested_at": a.created_at,
        "finished_at": a.finished_at,
        "result": a.result_json,
    }


def _refusal(node: dict[str, Any], kind: NodeActionKind) -> str | None:
    if node["pending"] is not None:
        return f"has a pending {node['pending']['kind']} by {node['pending']['requested_by']}"
    if kind is NodeActionKind.EXCLUDE and node["excluded"]:
        return f"is already excluded (by {node['excluded_by']})"
    if kind is NodeActionKind.RESTORE and not (
        node["excluded"] or node["health"] != NodeHealth.HEALTHY.value or node["excluded_by_runs"]
    ):
        return "is not excluded: nothing to restore"
    return None


def _view(
    name: str,
    row: Node | None,
    live_runs: Iterable[Run],
    indicted_by: list[dict[str, Any]],
    pending: NodeAction | None,
) -> dict[str, Any]:
    health = row.health if row is not None else NodeHealth.HEALTHY
    return {
        "name": name,
        "health": health.value,
        "strikes": row.strikes if row is not None else 0,
        "reason": row.reason if row is not None else None,
        "since": row.updated_at if row is not None and health is not NodeHealth.HEALTHY else None,
        "excluded": bool(row is not None and row.excluded),
        "excluded_by": row.excluded_by if row is not None else None,
        "excluded_at": row.excluded_at if row is not None else None,
        "excluded_by_runs": sorted(r.id for r in live_runs if name in _watchdog_excluded(r)),
        "indicted_by": indicted_by,
        "pending": node_action_view(pending) if pending is not None else None,
    }


def _live_runs(session: Session) -> list[Run]:
    return list(session.scalars(select(Run).where(Run.state.not_in(TERMINAL_RUN_STATES))))


def _watchdog_excluded(run: Run) -> set[str]:
    """The run's exclusions beyond its spec's own `resources.exclude`."""
    own = set((run.spec_json.get("resources") or {}).get("exclude") or ())
    return set(run.excluded_nodes_json or ()) - own


def _unexclude_from_runs(session: Session, name: str, note: str) -> list[str]:
    changed = []
    for run in _live_runs(session):
        if name in _watchdog_excluded(run):
            kept = sorted(n for n in run.excluded_nodes_json if n != name)
            session.execute(update(Run).where(Run.id == run.id).values(excluded_nodes_json=kept))
            record_event(session, run.id, EventKind.INFO, f"node {name} {note}",
                         run.current_attempt, node=name, excluded_nodes=kept)  # fmt: skip
            changed.append(run.id)
    return changed


def _indictments(session: Session) -> dict[str, list[dict[str, Any]]]:
    """Node → the watchdog's exclusions that named it (each one a strike), oldest first."""
    out: dict[str, list[dict[str, Any]]] = {}
    actions = session.scalars(
        select(Action).where(Action.kind == EXCLUDE_NODE_ACTION).order_by(Action.id)
    )
    for a in actions:
        ev = a.evidence_json or {}
        for name in ev.get("exclude_nodes") or ():
            out.setdefault(name, []).append({
                "run_id": a.run_id, "attempt": a.attempt, "incident_id": ev.get("incident_id"),
                "finding": ev.get("finding_kind"), "reason": ev.get("reason"),
                "at": a.created_at,
            })  # fmt: skip
    return out


def _pending(session: Session) -> list[NodeAction]:
    return list(
        session.scalars(
            select(NodeAction).where(NodeAction.state == ActionState.INTENT).order_by(NodeAction.id)
        )
    )
