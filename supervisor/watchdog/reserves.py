"""Spares that refill: reserve jobs for a running job whose spares a node fault used up.

A job holds `resources.spare_nodes` idle nodes; each node fault moves a bad node's ranks to
one of them inside the job. Once they are used, the next node fault would cancel and resubmit
(a queue wait and a cold start). The watchdog keeps the count instead: it submits a *reserve
job* of the missing nodes, whose node tasks join the running job as its spares
(`worker.task.TrainingTask.reserve_for`). Pure: what to submit, from what the tick read.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from supervisor.models import ActionState
from supervisor.slurm import JobState, JobStatus

#: Reserve jobs submitted for one job within `RESERVE_WINDOW_S` at most: a reserve that keeps
#: failing (a node that cannot start the task, a partition that refuses it) must not become a
#: submission loop, while a job that runs for days refills after every node fault.
MAX_RESERVES_PER_JOB = 8
RESERVE_WINDOW_S = 3600.0


@dataclass(frozen=True)
class Reserve:
    """A reserve job as its action recorded it."""

    seq: int
    count: int
    state: ActionState
    #: Its SLURM job (None: not submitted, or its submission's outcome not recorded yet).
    job_id: str | None = None
    #: The attempt its action is keyed by (None: not recorded yet; it will be the current one).
    #: A job outlives its attempts (restarts inside it), and so do its reserves' intents.
    attempt: int | None = None
    #: When its action was recorded (epoch seconds).
    recorded_at: float = 0.0

    @classmethod
    def from_action(
        cls,
        target: str,
        state: ActionState,
        attempt: int | None,
        evidence: Mapping[str, Any],
        result: Mapping[str, Any] | None,
        recorded_at: float = 0.0,
    ) -> Reserve:
        """From a `reserve` action: target `<job id>-r<seq>`, evidence {nodes}, result {job_id}."""
        seq = int(target.rsplit("-r", 1)[1])
        job_id = (result or {}).get("job_id")
        job = str(job_id) if job_id else None
        return cls(seq, int(evidence["nodes"]), state, job, attempt, recorded_at)


def running_nodes(
    reserves: Sequence[Reserve], statuses: Mapping[str, JobStatus]
) -> tuple[str, ...]:
    """The nodes of the reserve jobs SLURM runs now: the job's spares beside its own."""
    out: list[str] = []
    for r in reserves:
        status = statuses.get(r.job_id) if r.job_id else None
        if status is not None and status.state is JobState.RUNNING:
            out.extend(n for n in status.nodes if n not in out)
    return tuple(out)


def to_submit(
    spare_nodes: int,
    job_nodes: Sequence[str],
    attempt_nodes: Collection[str],
    excluded: Collection[str],
    reserves: Sequence[Reserve],
    statuses: Mapping[str, JobStatus],
    now: float,
) -> Reserve | None:
    """The reserve job to submit now, or None (also once `MAX_RESERVES_PER_JOB` were recorded
    within the last `RESERVE_WINDOW_S`).

    `job_nodes` are the job's nodes and its running reserves'; the idle ones that are not
    excluded are its spares. A reserve whose submission was cut short (its intent alone) is
    finished first, as recorded (its seq, count and attempt); reserves SLURM has not started
    yet (pending, or not listed yet) count as spares to come, so a pending one is never
    doubled. A new one is the next seq, of the missing count, not recorded yet."""
    unfinished = [r for r in reserves if r.state is ActionState.INTENT]
    if unfinished:
        return unfinished[0]
    missing = spare_nodes - len(idle_spares(job_nodes, attempt_nodes, excluded))
    missing -= sum(r.count for r in reserves if _coming(r, statuses))
    recent = sum(1 for r in reserves if now - r.recorded_at < RESERVE_WINDOW_S)
    if missing <= 0 or recent >= MAX_RESERVES_PER_JOB:
        return None
    seq = max((r.seq for r in reserves), default=0) + 1
    return Reserve(seq, missing, ActionState.INTENT)


def idle_spares(
    job_nodes: Sequence[str], attempt_nodes: Collection[str], excluded: Collection[str]
) -> list[str]:
    """The job's nodes (its reserves' included) that run no ranks and are not excluded."""
    return [n for n in job_nodes if n not in attempt_nodes and n not in excluded]


def _coming(reserve: Reserve, statuses: Mapping[str, JobStatus]) -> bool:
    if reserve.state is not ActionState.DONE or reserve.job_id is None:
        return False
    status = statuses.get(reserve.job_id)
    return status is None or status.state in (JobState.PENDING, JobState.REQUEUED, JobState.UNKNOWN)
