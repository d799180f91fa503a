"""Database tables (SQLAlchemy 2 typed models). Alembic owns the schema: see migrations/.

States are enums stored as their string values (no native DB enum), so a later migration can
add a state without an ALTER TYPE dance on PostgreSQL.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the offset otherwise)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; use timezone-aware UTC")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class RunState(enum.StrEnum):
    """Lifecycle of a run; this docstring is the state machine.

    ::

        pending ──▶ submitted ──▶ running ⇄ recovering
           │            │            │          │
           ▼            ▼            ▼          ▼
        cancelled    succeeded | failed | cancelled | needs_attention

    - pending: stored by the API, not yet handed to SLURM. Cancel here is immediate. A
      submission that keeps failing (restart budget spent) goes to needs_attention.
    - submitted: an attempt is queued in SLURM (or the local executor).
    - running: the attempt's job is running and training makes progress.
    - recovering: the watchdog is applying a remedy (rollback, exclude + resubmit, requeue);
      goes back to running when the new attempt makes progress.
    - succeeded / failed / cancelled: terminal.
    - needs_attention: a budget ran out or the fault is not one the watchdog can cure; a
      person decides (it can still be cancelled, or resumed to recovering by an operator).
    """

    PENDING = "pending"
    SUBMITTED = "submitted"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    NEEDS_ATTENTION = "needs_attention"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_RUN_STATES

    @property
    def active(self) -> bool:
        """A job may exist in SLURM for this run."""
        return self in ACTIVE_RUN_STATES


TERMINAL_RUN_STATES = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED})
ACTIVE_RUN_STATES = frozenset({RunState.SUBMITTED, RunState.RUNNING, RunState.RECOVERING})

RUN_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.PENDING: frozenset(
        {RunState.SUBMITTED, RunState.CANCELLED, RunState.FAILED, RunState.NEEDS_ATTENTION}
    ),
    RunState.SUBMITTED: frozenset(
        {RunState.RUNNING, RunState.RECOVERING, *TERMINAL_RUN_STATES, RunState.NEEDS_ATTENTION}
    ),
    RunState.RUNNING: frozenset(
        {RunState.RECOVERING, *TERMINAL_RUN_STATES, RunState.NEEDS_ATTENTION}
    ),
    RunState.RECOVERING: frozenset(
        {RunState.RUNNING, RunState.SUBMITTED, *TERMINAL_RUN_STATES, RunState.NEEDS_ATTENTION}
    ),
    RunState.NEEDS_ATTENTION: frozenset({RunState.RECOVERING, RunState.CANCELLED, RunState.FAILED}),
    RunState.SUCCEEDED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.CANCELLED: frozenset(),
}


def can_transition(old: RunState, new: RunState) -> bool:
    return new in RUN_TRANSITIONS[old]


class AttemptState(enum.StrEnum):
    """One SLURM submission: submitted → running → one terminal state (SLURM's words)."""

    SUBMITTED = "submitted"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    TIMEOUT = "timeout"
    NODE_FAIL = "node_fail"
    OUT_OF_MEMORY = "out_of_memory"
    LOST = "lost"


class EventKind(enum.StrEnum):
    STATE_CHANGE = "state_change"
    INCIDENT = "incident"
    ACTION_INTENT = "action_intent"
    ACTION_OUTCOME = "action_outcome"
    CHECKPOINT = "checkpoint"
    INFO = "info"


class IncidentState(enum.StrEnum):
    OPEN = "open"
    REMEDYING = "remedying"
    RECOVERED = "recovered"
    ESCALATED = "escalated"


class ActionState(enum.StrEnum):
    INTENT = "intent"
    DONE = "done"
    FAILED = "failed"


class NodeHealth(enum.StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    EXCLUDED = "excluded"


def _enum(cls: type[enum.Enum]) -> Enum:
    return Enum(
        cls,
        native_enum=False,
        create_constraint=False,
        length=32,
        values_callable=lambda e: [m.value for m in e],
    )


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime,
        dict[str, Any]: JSON,
        list[Any]: JSON,
    }


class Run(Base):
    __tablename__ = "runs"
    # An Idempotency-Key is the caller's own: the same key from two owners names two runs.
    __table_args__ = (
        Index("uq_runs_owner_idempotency_key", "owner", "idempotency_key", unique=True),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), index=True)
    spec_json: Mapped[dict[str, Any]]
    state: Mapped[RunState] = mapped_column(_enum(RunState), index=True)
    state_reason: Mapped[str | None] = mapped_column(Text)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    created_by: Mapped[str | None] = mapped_column(String(64), doc="The submitting token's id.")
    owner: Mapped[str] = mapped_column(
        String(64),
        default="",
        doc="The submitting principal (its token's owner); '' when none: only admin may write.",
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    current_attempt: Mapped[int] = mapped_column(Integer, default=0)
    skip_ranges_json: Mapped[list[Any]] = mapped_column(default=list)
    excluded_nodes_json: Mapped[list[Any]] = mapped_column(default=list)
    target_steps: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    resume_step: Mapped[int | None] = mapped_column(BigInteger)
    progress_json: Mapped[dict[str, Any] | None] = mapped_column(
        doc="What the watchdog last observed of the run (supervisor.watchdog.progress)."
    )
    operator_request_json: Mapped[dict[str, Any] | None] = mapped_column(
        doc="A pending operator request (resume / rollback) the reconciler carries out."
    )


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("run_id", "number", name="uq_attempts_run_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[str | None] = mapped_column(String(64), index=True)
    executor: Mapped[str] = mapped_column(String(16))
    nodes_json: Mapped[list[Any]] = mapped_column(default=list)
    state: Mapped[AttemptState] = mapped_column(_enum(AttemptState))
    submitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    exit_code: Mapped[int | None] = mapped_column(Integer)
    end_reason: Mapped[str | None] = mapped_column(Text)
    resume_step: Mapped[int | None] = mapped_column(BigInteger)
    skip_ranges_json: Mapped[list[Any]] = mapped_column(default=list)
    exclude_json: Mapped[list[Any]] = mapped_column(default=list)
    first_step_s: Mapped[float | None] = mapped_column(
        Float, doc="Start to first step (s): the run's slowest sets its start-up hang limit."
    )


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "step", name="uq_checkpoints_run_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(BigInteger)
    consumed_samples: Mapped[int] = mapped_column(BigInteger)
    loss: Mapped[float | None] = mapped_column(Float)
    path: Mapped[str] = mapped_column(Text)
    saved_at: Mapped[datetime]
    complete: Mapped[bool] = mapped_column(Boolean, default=False)


class Event(Base):
    """Append-only timeline of a run: what happened, and the evidence for it."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_id_id", "run_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int | None] = mapped_column(Integer)
    ts: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[EventKind] = mapped_column(_enum(EventKind))
    message: Mapped[str] = mapped_column(Text)
    data_json: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Incident(Base):
    __tablename__ = "incidents"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int | None] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(64))
    fault_ts: Mapped[datetime | None]
    detected_ts: Mapped[datetime] = mapped_column(default=utcnow)
    remedy: Mapped[str | None] = mapped_column(String(64))
    recovered_ts: Mapped[datetime | None]
    steps_lost: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[IncidentState] = mapped_column(_enum(IncidentState))
    evidence_json: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Action(Base):
    """A change to the world, keyed run|attempt|kind|target so a replay is a no-op."""

    __tablename__ = "actions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int | None] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(128))
    state: Mapped[ActionState] = mapped_column(_enum(ActionState))
    evidence_json: Mapped[dict[str, Any]] = mapped_column(default=dict)
    result_json: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class Node(Base):
    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    health: Mapped[NodeHealth] = mapped_column(_enum(NodeHealth), default=NodeHealth.HEALTHY)
    strikes: Mapped[int] = mapped_column(Integer, default=0)
    reason: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    excluded: Mapped[bool] = mapped_column(
        Boolean,
        default=False,
        server_default=false(),
        doc="An operator excluded it: every run's next submission avoids it (SLURM --exclude).",
    )
    excluded_by: Mapped[str | None] = mapped_column(String(64))
    excluded_at: Mapped[datetime | None]


class NodeActionKind(enum.StrEnum):
    EXCLUDE = "exclude"
    RESTORE = "restore"


class NodeAction(Base):
    """An operator's exclude / restore of a node: the API writes it as an intent with its
    evidence, the reconciler carries it out and records the outcome (docs/api.md, Nodes)."""

    __tablename__ = "node_actions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    node: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[NodeActionKind] = mapped_column(_enum(NodeActionKind))
    state: Mapped[ActionState] = mapped_column(_enum(ActionState), index=True)
    requested_by: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(Text)
    evidence_json: Mapped[dict[str, Any]] = mapped_column(default=dict)
    result_json: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class Token(Base):
    """An API token. Only the sha256 of the secret is stored; the secret is shown once."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(
        String(64), doc="The principal (person or team) its runs belong to; default: the name."
    )
    scopes: Mapped[list[Any]] = mapped_column(default=list)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    run_id: Mapped[str | None] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"),
        doc="Set for per-run worker tokens: they may only touch that run.",
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)


class Endpoint(Base):
    """A worker node's metrics endpoint for one attempt; last_seen is its heartbeat."""

    __tablename__ = "endpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "attempt", "node", name="uq_endpoints_run_attempt_node"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(128))
    host: Mapped[str] = mapped_column(String(255))
    port: Mapped[int] = mapped_column(Integer)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)


class Lease(Base):
    """Who may act: the reconciler replica holding an unexpired lease. `epoch` grows each
    time the lease changes hands; every side effect is fenced with it (docs/contracts.md)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime]
    epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class OutboxMessage(Base):
    """A webhook notification, written in the transaction that decided it and kept until the
    webhook accepted it (at least once: `key` is the idempotency id receivers dedupe on)."""

    __tablename__ = "outbox"
    __table_args__ = (Index("ix_outbox_due", "delivered_at", "next_try_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    run_id: Mapped[str | None] = mapped_column(String(32))
    payload_json: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    tries: Mapped[int] = mapped_column(Integer, default=0)
    next_try_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None]
    last_error: Mapped[str | None] = mapped_column(Text)
