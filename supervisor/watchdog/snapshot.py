"""Plain data passed between the watchdog's stages: what was observed, found and decided.

These are frozen dataclasses with no I/O so detectors and policy can be tested on recorded
snapshots, and so a Snapshot from Prometheus and one from a direct scrape are the same thing.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from contracts.anomalies import Anomaly
from supervisor.metrics_in.types import MetricsView, SourceHealth
from supervisor.models import AttemptState


class Cause(enum.StrEnum):
    """What a fault is blamed on; the policy escalates from one suspicion to the next."""

    DATA = "data"
    NODE = "node"
    INFRA = "infra"  # preemption, walltime: nobody's fault
    CODE = "code"  # config / program error: a person must look
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class JobView:
    """SLURM's answer for the attempt's job (from one batched poll for all runs), in the
    attempt's words (`supervisor.slurm.JobState.attempt_state`); LOST: SLURM answered and does
    not know the job."""

    health: SourceHealth
    state: AttemptState | None = None
    job_id: str | None = None
    nodes: tuple[str, ...] = ()
    exit_code: int | None = None
    reason: str | None = None  # classified log cause or SLURM reason, e.g. "NCCL error"
    failed_nodes: tuple[str, ...] = ()
    cause: Cause | None = None  # from the job's log, when it was classified
    #: RUNNING as SLURM's COMPLETING: the job is ending, `nodes` lists only those still
    #: cleaning up, and its final state comes on a later tick.
    completing: bool = False
    #: Seconds until the job's time limit at this tick's poll (None: no limit or unknown).
    time_left_s: float | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the detectors may look at for one run at one tick."""

    run_id: str
    attempt: int
    now: float
    metrics: MetricsView
    job: JobView
    checkpoint_interval_steps: int = 100
    global_batch_size: int = 1
    warmup_steps: int = 0  # the learning rate's warmup (`training.lr_warmup_steps`)
    target_steps: int | None = None
    disk_checkpoint_step: int | None = None  # newest complete checkpoint on disk
    attempt_started_at: float | None = None  # when SLURM was first seen running the job
    # Slowest start → first step of this run's attempts seen by this supervisor process.
    startup_seconds_seen: float | None = None
    #: The trainer's records of this attempt's bad steps (`contracts.anomalies`), oldest first.
    anomalies: tuple[Anomaly, ...] = ()


class FindingKind(enum.StrEnum):
    NONFINITE = "nonfinite"
    LOSS_SPIKE = "loss_spike"
    GRAD_EXPLOSION = "grad_explosion"
    THROUGHPUT_DROP = "throughput_drop"
    STRAGGLER = "straggler"
    HANG = "hang"
    REPLICA_MISMATCH = "replica_mismatch"
    CHECKPOINT_FAILURE = "checkpoint_failure"
    CHECKPOINT_STALL = "checkpoint_stall"
    JOB_NODE_FAIL = "job_node_fail"
    JOB_PREEMPTED = "job_preempted"
    JOB_TIMEOUT = "job_timeout"
    JOB_FAILED = "job_failed"
    JOB_OOM = "job_oom"
    JOB_CANCELLED = "job_cancelled"
    JOB_LOST = "job_lost"
    JOB_ENDED_EARLY = "job_ended_early"  # exit 0 before target: walltime chaining
    JOB_NO_GPU = "job_no_gpu"  # a GPU run's rank found fewer GPUs than it was given
    #: A resumed attempt's first validation loss jumped above its checkpoint's recorded one.
    EVAL_JUMP = "eval_jump"
    #: Bad steps the trainer contained (updates skipped, or a tolerated spike): recorded as an
    #: incident with its evidence, no remedy.
    CONTAINED = "contained"


#: Faults of the training numerics: the same remedy ladder (data → node → person) applies.
NUMERIC_FAULTS = frozenset(
    {FindingKind.NONFINITE, FindingKind.LOSS_SPIKE, FindingKind.GRAD_EXPLOSION}
)


@dataclass(frozen=True, slots=True)
class Finding:
    """A detector's conclusion with the evidence for it.

    `last_healthy_step` / `first_bad_step` bound the onset; `sample_window` is the half-open
    range of global sample indices consumed between them (what a data remedy skips).
    `fault_time` is the time of the first bad observation (or of the job's end).
    """

    kind: FindingKind
    summary: str
    cause: Cause = Cause.UNKNOWN
    evidence: Mapping[str, Any] = field(default_factory=dict)
    fault_time: float | None = None
    last_healthy_step: int | None = None
    first_bad_step: int | None = None
    sample_window: tuple[int, int] | None = None
    nodes: tuple[str, ...] = ()
    #: The exact bad samples, when the trainer named them: a data remedy skips these (plus the
    #: spec's margin) instead of the whole `sample_window`.
    bad_samples: tuple[tuple[int, int], ...] = ()


class RemedyKind(enum.StrEnum):
    """What the policy may ask for. Only NONE and OBSERVE leave the job alone."""

    NONE = "none"
    OBSERVE = "observe"  # record + notify only (non-destructive)
    RESTART = "restart"  # resubmit from the newest checkpoint
    ROLLBACK = "rollback"  # resubmit from a checkpoint before onset, skipping samples
    EXCLUDE_NODE = "exclude_node"  # exclude node(s) and resubmit from the newest checkpoint
    REQUEUE = "requeue"  # continue after preemption / walltime
    ESCALATE = "escalate"  # NEEDS_ATTENTION + notify

    @property
    def resubmits(self) -> bool:
        return self in (
            RemedyKind.RESTART,
            RemedyKind.ROLLBACK,
            RemedyKind.EXCLUDE_NODE,
            RemedyKind.REQUEUE,
        )


@dataclass(frozen=True, slots=True)
class Remedy:
    """The one thing to do for a run this tick, and why."""

    kind: RemedyKind
    reason: str
    finding: Finding | None = None
    suspect: Cause = Cause.UNKNOWN
    to_step: int | None = None  # checkpoint to resume from; None = newest, 0 = from scratch
    skip_ranges: tuple[tuple[int, int], ...] = ()
    exclude_nodes: tuple[str, ...] = ()
    operator_request: str | None = None  # the id of the operator request it carries out

    @property
    def target(self) -> str:
        """Part of the action's idempotency key: what the action is applied to."""
        if self.operator_request is not None:
            return f"operator:{self.operator_request}"
        if self.kind is RemedyKind.EXCLUDE_NODE:
            return ",".join(sorted(self.exclude_nodes))
        if self.kind is RemedyKind.ROLLBACK:
            return f"step={self.to_step}"
        return self.finding.kind.value if self.finding else "-"


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    step: int
    saved_at: float
    consumed_samples: int | None = None


@dataclass(frozen=True, slots=True)
class PastRemedy:
    """A remedy applied earlier to this run (from the actions/incidents tables)."""

    kind: RemedyKind
    attempt: int
    at: float
    finding_kind: FindingKind | None = None
    step: int | None = None  # training step when the remedy was decided
    skip_ranges: tuple[tuple[int, int], ...] = ()
    excluded: tuple[str, ...] = ()
    attempt_nodes: tuple[str, ...] = ()
    incident_id: int | None = None
    finding_nodes: tuple[str, ...] = ()  # nodes the finding named (a crash: the crashed rank's)
    failed: bool = False  # its resubmission failed (counts against the budget, backs off)


@dataclass(frozen=True, slots=True)
class RunHistory:
    """What the policy needs to know about the past: remedies, nodes, checkpoints."""

    remedies: tuple[PastRemedy, ...] = ()
    excluded_nodes: frozenset[str] = frozenset()
    node_strikes: Mapping[str, int] = field(default_factory=dict)
    checkpoints: tuple[CheckpointRef, ...] = ()
    attempt_nodes: tuple[str, ...] = ()
    usable_nodes: frozenset[str] | None = None  # up, not drained (None: SLURM did not say)
    nodes_needed: int = 1
