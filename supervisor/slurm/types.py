"""The words shared by every cluster backend: job and node states, requests, answers, errors,
and the `Cluster` protocol that the launcher, the reconciler and the actuator call.

SLURM's job states are translated once, here (`JobState.attempt_state`), into the attempt's
state (`supervisor.models.AttemptState`), the one vocabulary the watchdog and the database use.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from supervisor.models import AttemptState


class SourceUnavailable(RuntimeError):
    """SLURM could not be asked (timeout, daemon down, bad output): state unknown, not gone."""


class Unsupported(RuntimeError):
    """The cluster kind cannot do this (e.g. draining a node of the local executor)."""


class InvalidRequest(Unsupported):
    """A string bound for sbatch or scontrol breaks its pattern (`contracts.slurm_names`):
    never sent. The spec refuses such strings; this guards anything stored before it did."""


class JobState(enum.StrEnum):
    """How SLURM sees a job, in SLURM's words (`parse.parse_state` folds its aliases in).

    PENDING / REQUEUED → waiting; RUNNING (and COMPLETING, SUSPENDED) → running;
    everything else is terminal. UNKNOWN means "not seen yet or not parseable", never "gone".
    """

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    REQUEUED = "REQUEUED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    TIMEOUT = "TIMEOUT"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    UNKNOWN = "UNKNOWN"

    @property
    def terminal(self) -> bool:
        return self not in _ACTIVE

    @property
    def active(self) -> bool:
        return self in _ACTIVE and self is not JobState.UNKNOWN

    @property
    def attempt_state(self) -> AttemptState | None:
        """The attempt's state this SLURM state means; None for UNKNOWN (change nothing).

        A job that failed to boot is a node failure, a missed deadline a time limit. The one
        reading that needs more than the state (FAILED with exit 75, a checkpoint on a stop
        signal, recorded as preempted) is the reconciler's, which has the exit code.
        """
        return _ATTEMPT_STATE.get(self)


_ACTIVE = frozenset({JobState.PENDING, JobState.RUNNING, JobState.REQUEUED, JobState.UNKNOWN})

_ATTEMPT_STATE: dict[JobState, AttemptState] = {
    JobState.PENDING: AttemptState.SUBMITTED,
    JobState.REQUEUED: AttemptState.SUBMITTED,
    JobState.RUNNING: AttemptState.RUNNING,
    JobState.COMPLETED: AttemptState.COMPLETED,
    JobState.FAILED: AttemptState.FAILED,
    JobState.CANCELLED: AttemptState.CANCELLED,
    JobState.NODE_FAIL: AttemptState.NODE_FAIL,
    JobState.BOOT_FAIL: AttemptState.NODE_FAIL,
    JobState.PREEMPTED: AttemptState.PREEMPTED,
    JobState.TIMEOUT: AttemptState.TIMEOUT,
    JobState.DEADLINE: AttemptState.TIMEOUT,
    JobState.OUT_OF_MEMORY: AttemptState.OUT_OF_MEMORY,
}


class NodeState(enum.StrEnum):
    """A node's base state, as sinfo's compact `%t` names it (its flag suffixes apart).

    A word this list lacks is UNKNOWN: neither down nor drained, as SLURM's own "unk" is.
    """

    IDLE = "idle"
    ALLOCATED = "alloc"
    MIXED = "mix"
    COMPLETING = "comp"
    DRAINED = "drain"
    DRAINING = "drng"
    DOWN = "down"
    FAIL = "fail"
    FAILING = "failg"
    FUTURE = "futr"
    MAINTENANCE = "maint"
    RESERVED = "resv"
    PLANNED = "plnd"
    POWERING_DOWN = "pow_dn"
    POWERING_UP = "pow_up"
    REBOOTING = "boot"
    BLOCKED = "blocked"
    INVALID = "inval"
    UNKNOWN = "unk"


#: sinfo's flag after a compact state that means SLURM lost touch with the node.
NOT_RESPONDING = "*"


@dataclass(frozen=True)
class NodeInfo:
    """One node as sinfo lists it: base state, flag suffixes (`*` not responding, `~` powered
    off, `$` in a maintenance reservation, …) and the reason an operator or SLURM gave."""

    name: str
    state: NodeState
    reason: str = ""
    flags: str = ""

    @property
    def down(self) -> bool:
        return (
            self.state in (NodeState.DOWN, NodeState.FAIL, NodeState.FAILING)
            or NOT_RESPONDING in self.flags
        )

    @property
    def drained(self) -> bool:
        """Drained or draining: SLURM starts no new job there."""
        return self.state in (NodeState.DRAINED, NodeState.DRAINING)

    @property
    def usable(self) -> bool:
        """Up and not drained: a node a new job may be given."""
        return not self.down and not self.drained

    @property
    def idle(self) -> bool:
        return self.state is NodeState.IDLE and not self.flags


@dataclass(frozen=True)
class JobStatus:
    """One job as the batched poll saw it."""

    job_id: str
    state: JobState
    nodes: tuple[str, ...] = ()
    exit_code: int | None = None
    exit_signal: int | None = None
    reason: str = ""
    raw_state: str = ""
    failed_nodes: tuple[str, ...] = ()
    #: Seconds until the job's time limit when polled (None: no limit, or not known).
    time_left_s: float | None = None

    @property
    def completing(self) -> bool:
        """SLURM is tearing the job down: its final state is pending, and its node list
        holds only the nodes still cleaning up (a lost node is already gone from it)."""
        return self.raw_state.upper().startswith("COMPLETING")


@dataclass(frozen=True)
class LiveJob:
    """A queued or running job as the sweep for strays lists it."""

    name: str
    #: The nodes it runs on (empty while it waits).
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobRequest:
    """Everything sbatch needs for one attempt; built by `supervisor.launcher` (pure)."""

    job_name: str
    log_dir: Path
    nodes: int
    tasks_per_node: int
    cpus_per_task: int = 1
    gpus_per_node: int | None = None
    memory_gib: int | None = None
    exclusive: bool = False
    time_limit_minutes: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    exclude: tuple[str, ...] = ()
    signal_delay_s: int = 90
    requeue: bool = False
    #: The job (and its step) outlives a failed node (`--no-kill`): a job holding spares moves
    #: a dead node's ranks to one inside the allocation, which SLURM's default kill would end.
    no_kill: bool = False
    #: Fewer nodes the job may start on (`--nodes=<min>-<nodes>`): SLURM gives it as many as
    #: are free then, at least this many. A job's spares must not hold its start back.
    min_nodes: int | None = None
    #: Ranks each task forks (`worker.ranks`): not SLURM's concern, but a job's exit codes
    #: are recorded per rank, and the local executor counts them.
    ranks_per_task: int = 1
    #: Interpreter and shell lines the batch script runs the task with (`launcher.NodeSetup`).
    python: str | None = None
    setup: tuple[str, ...] = ()


@dataclass(frozen=True)
class Submission:
    job_id: str
    log_dir: Path


class Cluster(Protocol):
    """Everything the launcher, the reconciler and the actuator ask of a cluster.

    Every backend implements all of it: what one cannot do raises `Unsupported`, or gives the
    empty answer its docstring names. A query that could not be made raises
    `SourceUnavailable`, never an empty answer.
    """

    kind: str

    def submit(self, request: JobRequest, fn: Callable[[], object]) -> Submission: ...

    def poll(self, job_ids: Sequence[str]) -> dict[str, JobStatus]: ...

    def find_jobs(self, job_name: str) -> list[str]:
        """Ids of the jobs named `job_name`, oldest first."""
        ...

    def live_jobs(self, prefix: str) -> dict[str, LiveJob]:
        """Queued or running jobs named `prefix…`: id → name and nodes."""
        ...

    def finish_submission(self, job_id: str, log_dir: Path) -> bool:
        """Finish a submission cut short between sbatch and the job's pickle; True if it was."""
        ...

    def cancel(self, job_id: str) -> None: ...

    def requeue(self, job_id: str) -> None: ...

    def signal(self, job_id: str, sig: str = "USR2") -> None: ...

    def drain(self, node: str, reason: str) -> None: ...

    def resume_node(self, node: str) -> None: ...

    def nodes(self) -> dict[str, NodeInfo]: ...

    def log_files(self, job_id: str, log_dir: Path | None = None) -> list[Path]: ...
