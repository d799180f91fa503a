"""Runs: created idempotently, listed, counted, moved between states by compare-and-set."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, func, insert, or_, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from contracts.spec import RunSpec
from supervisor.models import (
    Attempt,
    Event,
    EventKind,
    Run,
    RunState,
    can_transition,
    utcnow,
)
from supervisor.roots import ancestors, overlaps
from supervisor.store.errors import CheckpointDirInUse, Conflict, IdempotencyConflict, NotFound
from supervisor.store.events import record_event
from supervisor.store.tokens import revoke_run_tokens


def spec_hash(spec: RunSpec) -> str:
    """Hash of the canonical spec: the same run described with other whitespace or key order
    (or with defaults spelled out) is the same request."""
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()


def create_run(
    session: Session,
    spec: RunSpec,
    *,
    created_by: str | None = None,
    idempotency_key: str | None = None,
    owner: str = "",
) -> tuple[Run, bool]:
    """Persist a new pending run in a transaction of its own; returns (run, created).

    A retry with the same Idempotency-Key (and owner) returns the first run (created False);
    the same key with another spec raises IdempotencyConflict, a checkpoint.dir in use
    CheckpointDirInUse."""
    try:
        (outcome,) = add_runs(session, [NewRun(spec, created_by, idempotency_key, owner)])
        if isinstance(outcome, Conflict):  # the key's, or the checkpoint folder's
            raise outcome
        row, created = outcome
        run = session.get_one(Run, row["id"])  # before the commit, which ends the write lock
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return run, created


@dataclass(frozen=True)
class NewRun:
    """One `POST /v1/runs` for `add_runs`."""

    spec: RunSpec
    created_by: str | None = None
    idempotency_key: str | None = None
    owner: str = ""


def add_runs(
    session: Session, requests: Sequence[NewRun]
) -> list[tuple[dict[str, Any], bool] | Conflict]:
    """Add pending runs to the session's transaction (the caller commits); per request, the
    run's columns and whether this request created it, or the key's conflict.

    A key belongs to its owner: the same key from two owners makes two runs, and a conflict
    only ever names the owner's own run. A retry with the same (owner, key) gets the first run
    (created False), the same key with another spec an IdempotencyConflict. Three statements
    whatever the batch size: one INSERT of every run (a key already taken does nothing, and the
    unique index decides, so there is no check-then-insert race), one SELECT of the runs
    holding the keys that lost, one INSERT of the creation events. A retry within the batch is
    answered like one after it. A run whose checkpoint.dir another run uses is refused
    (`CheckpointDirInUse`).
    """
    table = Run.__table__
    rows = [_new_run_row(r) for r in requests]
    connection = session.connection()
    refused = _checkpoint_dirs_in_use(connection, rows)
    first_by_key: dict[tuple[str, str], dict[str, Any]] = {}
    fresh = []
    for row in rows:
        key = _scoped_key(row)
        if row["id"] in refused or (key is not None and key in first_by_key):
            continue
        fresh.append(row)
        if key is not None:
            first_by_key[key] = row
    insert_runs = _dialect_insert(session)(table).on_conflict_do_nothing(
        index_elements=[table.c.owner, table.c.idempotency_key]
    )  # executed with a list of rows: one multi-row INSERT, its SQL compiled once and cached
    returning = insert_runs.returning(table.c.id)
    created = set(connection.execute(returning, fresh).scalars()) if fresh else set()
    holders = {k: row for k, row in first_by_key.items() if row["id"] in created}
    if lost := [k for k in first_by_key if k not in holders]:
        taken = connection.execute(
            select(table).where(tuple_(table.c.owner, table.c.idempotency_key).in_(lost))
        )
        holders |= {(r.owner, r.idempotency_key): r._asdict() for r in taken}
    if created:
        connection.execute(
            insert(Event.__table__),
            [
                {"run_id": run_id, "attempt": None, "kind": EventKind.STATE_CHANGE,
                 "message": "run created (pending)", "data_json": {"to": "pending"}}
                for run_id in sorted(created)
            ],
        )  # fmt: skip
    outcomes: list[tuple[dict[str, Any], bool] | Conflict] = []
    for row in rows:
        if row["id"] in refused:
            outcomes.append(CheckpointDirInUse("checkpoint.dir is in use by another run"))
            continue
        if row["id"] in created:
            outcomes.append((row, True))
            continue
        holder = holders[_scoped_key(row)]
        if holder["request_hash"] != row["request_hash"]:
            message = f"Idempotency-Key already used for run {holder['id']} with another spec"
            outcomes.append(IdempotencyConflict(message))
        else:
            outcomes.append((holder, False))
    return outcomes


def _scoped_key(row: dict[str, Any]) -> tuple[str, str] | None:
    key = row["idempotency_key"]
    return None if key is None else (row["owner"], key)


def _checkpoint_dirs_in_use(connection: Any, rows: list[dict[str, Any]]) -> set[str]:
    """Ids of the new runs whose checkpoint.dir is, holds or lies inside another run's (any
    state: a finished run's checkpoints are its product), stored or earlier in this batch.

    Two runs in one folder resume from and prune each other's checkpoints. The paths are
    resolved before they are stored (`supervisor.roots`); default folders live under
    `$NIGHTWATCH_HOME/runs`, where no spec may point. A retry of a stored run (same
    Idempotency-Key and owner) is not refused for the folder it already holds. PostgreSQL serializes
    these checks with a transaction-scoped advisory lock; SQLite writers are serial already.
    """
    wanted = [(row, row["spec_json"]["checkpoint"]["dir"]) for row in rows]
    wanted = [(row, folder) for row, folder in wanted if folder is not None]
    if not wanted:
        return set()
    if connection.dialect.name == "postgresql":
        connection.execute(select(func.pg_advisory_xact_lock(_CHECKPOINT_DIR_LOCK)))
    column = Run.__table__.c.spec_json[("checkpoint", "dir")].as_string()
    refused: set[str] = set()
    taken: list[tuple[tuple[str, str] | None, str]] = []  # (scoped key, folder) of this batch
    table = Run.__table__
    for row, folder in wanted:
        key = _scoped_key(row)
        clash = select(table.c.owner, table.c.idempotency_key).where(
            or_(
                column.in_([folder, *ancestors(folder)]),
                func.substr(column, 1, len(folder) + 1) == folder + "/",
            )
        )
        holders = {
            None if k is None else (owner, k) for owner, k in connection.execute(clash).all()
        }
        holders |= {k for k, other in taken if overlaps(folder, other)}
        if holders - {key} or (holders and key is None):
            refused.add(row["id"])
        else:
            taken.append((key, folder))
    return refused


#: pg_advisory_xact_lock key of the checkpoint.dir check (any constant unique to it).
_CHECKPOINT_DIR_LOCK = 0x6E77636B  # "nwck"


def _new_run_row(request: NewRun) -> dict[str, Any]:
    spec, now = request.spec, utcnow()
    return {
        "id": f"r-{secrets.token_hex(6)}",
        "name": spec.name,
        "spec_json": spec.model_dump(mode="json"),
        "state": RunState.PENDING,
        "state_reason": None,
        "cancel_requested": False,
        "idempotency_key": request.idempotency_key,
        "request_hash": spec_hash(spec),
        "created_by": request.created_by,
        "owner": request.owner,
        "created_at": now,
        "updated_at": now,
        "current_attempt": 0,
        "skip_ranges_json": [],
        "excluded_nodes_json": list(spec.resources.exclude),
        "target_steps": spec.training.train_steps,
        "last_step": None,
        "resume_step": None,
    }


def _dialect_insert(session: Session) -> Any:
    """INSERT with ON CONFLICT for the session's database (SQLAlchemy spells it per dialect)."""
    if session.get_bind().dialect.name == "sqlite":
        return sqlite_insert
    return postgresql_insert


def get_run(session: Session, run_id: str) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        session.rollback()
        raise NotFound(f"run {run_id} not found")
    return run


def run_with_attempts(session: Session, run_id: str) -> tuple[Row[Any], Sequence[Row[Any]]]:
    """The run's row and its attempts' rows, for `GET /v1/runs/{id}`.

    Core rather than the ORM: the API's most frequent request builds no objects it would only
    copy into a response (half its database CPU went to the ORM's identity map and loading)."""
    connection = session.connection()
    run = connection.execute(select(Run.__table__).where(Run.id == run_id)).one_or_none()
    if run is None:
        session.rollback()
        raise NotFound(f"run {run_id} not found")
    attempts = connection.execute(
        select(Attempt.__table__).where(Attempt.run_id == run_id).order_by(Attempt.number)
    ).all()
    return run, attempts


@dataclass(frozen=True)
class Page:
    items: Sequence[Any]
    total: int


def list_runs(
    session: Session,
    *,
    states: Sequence[RunState] = (),
    name: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> Page:
    """Runs newest first, optionally filtered by state(s) and exact name."""
    query = select(Run)
    if states:
        query = query.where(Run.state.in_(states))
    if name:
        query = query.where(Run.name == name)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(
        query.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit).offset(offset)
    ).all()
    return Page(rows, total)


def runs_in_states(session: Session, states: Iterable[RunState]) -> Sequence[Run]:
    """For the reconciler: e.g. pending runs to submit, active runs to watch."""
    return session.scalars(select(Run).where(Run.state.in_(list(states))).order_by(Run.id)).all()


def run_states(session: Session, states: Iterable[RunState]) -> dict[str, RunState]:
    """run id → state, for the runs in one of `states`."""
    rows = session.execute(select(Run.id, Run.state).where(Run.state.in_(list(states))))
    return {run_id: state for run_id, state in rows}


def count_runs_by_state(session: Session) -> dict[RunState, int]:
    rows = session.execute(select(Run.state, func.count()).group_by(Run.state)).all()
    counts = dict.fromkeys(RunState, 0)
    counts.update({state: n for state, n in rows})
    return counts


def transition_run(
    session: Session,
    run_id: str,
    new: RunState,
    *,
    expected: Iterable[RunState] | None = None,
    reason: str | None = None,
    attempt: int | None = None,
    data: dict[str, Any] | None = None,
    **fields: Any,
) -> bool:
    """Compare-and-set the run's state (and other columns); False if someone got there first.

    `expected` defaults to every state that may legally move to `new`.
    """
    allowed = (
        set(expected) if expected is not None else {s for s in RunState if can_transition(s, new)}
    )
    allowed = {s for s in allowed if can_transition(s, new)}
    if not allowed:
        return False
    # FOR UPDATE (PostgreSQL; SQLite write sessions already hold the lock) so the event names
    # the state this update really replaced.
    current = session.scalar(select(Run.state).where(Run.id == run_id).with_for_update())
    if current is None:
        session.rollback()
        raise NotFound(f"run {run_id} not found")
    result = session.execute(
        update(Run)
        .where(Run.id == run_id, Run.state.in_(allowed))
        .values(state=new, state_reason=reason, updated_at=utcnow(), **fields)
    )
    if result.rowcount != 1:
        session.rollback()
        return False
    if new.terminal:
        revoke_run_tokens(session, run_id)
    message = f"{current.value} → {new.value}" + (f": {reason}" if reason else "")
    record_event(
        session,
        run_id,
        EventKind.STATE_CHANGE,
        message,
        attempt=attempt,
        **{"from": current.value, "to": new.value, **(data or {})},
    )
    session.commit()
    return True


def request_cancel(session: Session, run_id: str) -> Run:
    """Cancel now when nothing was submitted yet, else flag it for the reconciler.

    Ends with no transaction open, so a write session never holds the SQLite lock while the
    response is serialized.
    """
    run = get_run(session, run_id)
    if run.state.terminal and run.state != RunState.CANCELLED:
        session.rollback()
        raise Conflict(f"run {run_id} already {run.state.value}")
    if run.state == RunState.PENDING and run.current_attempt == 0:
        transition_run(
            session, run_id, RunState.CANCELLED, expected=[RunState.PENDING],
            reason="cancelled by user",
        )  # fmt: skip
    elif not run.cancel_requested and run.state != RunState.CANCELLED:
        session.execute(
            update(Run).where(Run.id == run_id).values(cancel_requested=True, updated_at=utcnow())
        )
        record_event(
            session, run_id, EventKind.INFO, "cancel requested", attempt=run.current_attempt
        )
    session.commit()
    session.refresh(run)
    session.commit()
    return run


def set_progress(session: Session, progress: dict[str, dict[str, Any]]) -> None:
    """Runs' latest observed progress (run id → `supervisor.watchdog.progress`), in one
    statement: a tick writes the runs that moved at once, however many."""
    if progress:
        session.execute(
            update(Run), [{"id": run_id, "progress_json": p} for run_id, p in progress.items()]
        )
        session.commit()


def update_run(session: Session, run_id: str, **fields: Any) -> None:
    """Set progress columns (last_step, skip_ranges_json, excluded_nodes_json, resume_step…)."""
    result = session.execute(
        update(Run).where(Run.id == run_id).values(updated_at=utcnow(), **fields)
    )
    if result.rowcount != 1:
        session.rollback()
        raise NotFound(f"run {run_id} not found")
    session.commit()


def list_events(
    session: Session, run_id: str, *, after: int = 0, limit: int = 100
) -> Sequence[Event]:
    """Events of a run in order, after the given event id (a resumable cursor)."""
    get_run(session, run_id)
    return session.scalars(
        select(Event)
        .where(Event.run_id == run_id, Event.id > after)
        .order_by(Event.id)
        .limit(limit)
    ).all()
