"""State faults: replicas that disagree, checkpoints that stall or fail, jobs that ended."""

from __future__ import annotations

from contracts import exitcodes
from contracts.spec import RecoverySpec
from supervisor.metrics_in import SourceHealth
from supervisor.models import AttemptState
from supervisor.watchdog.blame import classify_failure
from supervisor.watchdog.detectors.common import (
    job_running,
    metrics_ok,
    onset_fields,
)
from supervisor.watchdog.snapshot import Cause, Finding, FindingKind, Snapshot


def detect_replica_mismatch(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Replicas that should be bit-identical differ: silent data corruption or a seeding bug."""
    if not metrics_ok(snap):
        return []
    samples = snap.metrics.samples
    first = next((i for i, s in enumerate(samples) if (s.replica_mismatches_total or 0) > 0), None)
    if first is None:
        return []
    healthy = samples[first - 1] if first > 0 else None
    latest = samples[-1]
    return [
        Finding(
            kind=FindingKind.REPLICA_MISMATCH,
            summary=f"{latest.replica_mismatches_total:g} replica checksum mismatches",
            cause=Cause.UNKNOWN,
            evidence={
                "mismatches": latest.replica_mismatches_total,
                "checks": latest.replica_checks_total,
            },
            **onset_fields(healthy, samples[first]),  # type: ignore[arg-type]
            nodes=snap.job.nodes,
        )
    ]


def detect_checkpoint_problems(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Failed saves, and checkpoints falling behind: more than factor × interval steps old."""
    if not metrics_ok(snap):
        return []
    latest = snap.metrics.samples[-1]
    out: list[Finding] = []
    if (latest.checkpoint_failures_total or 0) > 0:
        out.append(
            Finding(
                kind=FindingKind.CHECKPOINT_FAILURE,
                summary=f"{latest.checkpoint_failures_total:g} checkpoint saves failed",
                cause=Cause.INFRA,
                evidence={"failures": latest.checkpoint_failures_total},
                fault_time=latest.t,
            )
        )
    # A resumed process exports 0 until its first save: the checkpoint it resumed from, on
    # disk, counts as well.
    saved = [c for c in (latest.checkpoint_step, snap.disk_checkpoint_step) if c is not None]
    if latest.step is not None and saved:
        behind = latest.step - max(saved)
        limit = rc.checkpoint_stall_factor * snap.checkpoint_interval_steps
        if behind > limit:
            out.append(
                Finding(
                    kind=FindingKind.CHECKPOINT_STALL,
                    summary=f"newest checkpoint is {behind} steps old (limit {limit:.0f})",
                    cause=Cause.INFRA,
                    evidence={
                        "step": latest.step,
                        "checkpoint_step": max(saved),
                        "checkpoint_ts": latest.checkpoint_ts,
                    },
                    fault_time=latest.t,
                    last_healthy_step=max(saved),
                )
            )
    return out


_JOB_FINDINGS: dict[AttemptState, tuple[FindingKind, Cause]] = {
    AttemptState.NODE_FAIL: (FindingKind.JOB_NODE_FAIL, Cause.NODE),
    AttemptState.PREEMPTED: (FindingKind.JOB_PREEMPTED, Cause.INFRA),
    AttemptState.TIMEOUT: (FindingKind.JOB_TIMEOUT, Cause.INFRA),
    AttemptState.OUT_OF_MEMORY: (FindingKind.JOB_OOM, Cause.CODE),
    AttemptState.CANCELLED: (FindingKind.JOB_CANCELLED, Cause.UNKNOWN),
    AttemptState.LOST: (FindingKind.JOB_LOST, Cause.UNKNOWN),
}


def detect_job_state(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Terminal or bad SLURM states of the current attempt's job."""
    job = snap.job
    if job.health is not SourceHealth.UP or job.state is None:
        return []
    evidence = {
        "job_id": job.job_id,
        "state": job.state.value,
        "exit_code": job.exit_code,
        "reason": job.reason,
        "nodes": list(job.nodes),
    }
    step = snap.disk_checkpoint_step
    if job.state is AttemptState.COMPLETED:
        if step is None or snap.target_steps is None or step >= snap.target_steps:
            return []
        return [
            Finding(
                kind=FindingKind.JOB_ENDED_EARLY,
                summary=f"job ended at checkpoint {step} of {snap.target_steps}: continue",
                cause=Cause.INFRA,
                evidence=evidence,
                fault_time=snap.now,
                last_healthy_step=step,
            )
        ]
    summary = f"job {job.job_id} {job.state.value}" + (f": {job.reason}" if job.reason else "")
    if job.state is AttemptState.FAILED and job.exit_code == exitcodes.REQUEUE:
        # The trainer checkpointed on SLURM's TERM or USR2 and asked to be requeued: a
        # preemption or a walltime warning, not a failure (SLURM can only say FAILED 75).
        kind, cause = FindingKind.JOB_PREEMPTED, Cause.INFRA
        summary = f"job {job.job_id} checkpointed on a stop signal (exit 75): requeue"
    elif job.state is AttemptState.FAILED and job.exit_code == exitcodes.NO_GPU:
        # The job was given GPUs and a rank saw fewer: the node or the cluster's GPU set-up is
        # wrong, and the same request would fail the same way.
        kind, cause = FindingKind.JOB_NO_GPU, Cause.CODE
        summary = f"job {job.job_id}: a rank found no GPU (exit {exitcodes.NO_GPU})" + (
            f": {job.reason}" if job.reason else ""
        )
    elif job.state is AttemptState.FAILED:
        cause = job.cause or classify_failure(job.exit_code, job.reason)
        kind = FindingKind.JOB_FAILED
    elif job.state in _JOB_FINDINGS:
        kind, cause = _JOB_FINDINGS[job.state]
    else:
        return []
    # Only nodes SLURM names as failed are blamed directly; the policy infers the rest.
    nodes = job.failed_nodes
    return [
        Finding(
            kind=kind,
            summary=summary,
            cause=cause,
            evidence=evidence,
            fault_time=snap.now,
            last_healthy_step=step,
            nodes=nodes,
        )
    ]


def walltime_ends_within(snap: Snapshot, within_s: float) -> str | None:
    """Why this attempt will end at its time limit soon, or None: its job runs and SLURM's
    time left is within `within_s` (the stop signal's lead and the time a successor needs)."""
    left = snap.job.time_left_s
    if not job_running(snap) or left is None or left > within_s:
        return None
    return f"the job's time limit is {left:.0f} s away"
