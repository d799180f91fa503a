"""Turn a run + attempt plan into a submission.

Why pure helpers: the reconciler (supervisor.watchdog) calls this every tick, and the
decisions here (sbatch parameters, the task and its environment from a spec) must be testable
on plain data. The only side effect is `submit`, which hands the request to a
`supervisor.slurm.Cluster`. What an ended attempt means is the watchdog's (detectors, policy).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.checkpoints import SaveTiming
from contracts.spec import RunSpec
from supervisor.settings import Settings
from supervisor.slurm import Cluster, JobRequest, Submission
from worker.task import TrainingTask


@dataclass(frozen=True)
class NodeSetup:
    """How a job starts on its compute nodes, which need not share the supervisor's paths:
    the interpreter that runs the task and shell lines run before it (`module load`, a venv's
    activate, a container launcher). Server settings, never a spec: they run as the
    supervisor's user. The local executor ignores them (it runs this host's interpreter)."""

    python: str | None = None
    setup: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, settings: Settings) -> NodeSetup:
        return cls(settings.job_python, settings.job_setup)


#: The stop signal's lead before the time limit (SLURM `--signal=USR2@lead`) while no save of
#: the run has been measured, and its bounds: the trainer checkpoints at the next step boundary
#: on it, so the lead must cover a step and a whole save, with room to spare.
DEFAULT_SIGNAL_LEAD_S = 90
MIN_SIGNAL_LEAD_S = 60
MAX_SIGNAL_LEAD_S = 1800
SIGNAL_LEAD_FACTOR = 2.0
SIGNAL_LEAD_SLACK_S = 30


def signal_lead(
    timing: SaveTiming | None, time_limit_minutes: int, default: int = DEFAULT_SIGNAL_LEAD_S
) -> tuple[int, str]:
    """(seconds before the time limit to send the stop signal, why): twice the run's newest
    measured save and the step before it, plus slack, within [60 s, 30 min] and at most a
    quarter of the time limit; `default` until a save was measured (pure)."""
    cap = max(MIN_SIGNAL_LEAD_S, min(MAX_SIGNAL_LEAD_S, time_limit_minutes * 60 // 4))
    if timing is None:
        return min(default, cap), f"default {default} s (no save measured yet)"
    need = SIGNAL_LEAD_FACTOR * (timing.seconds + timing.step_seconds) + SIGNAL_LEAD_SLACK_S
    lead = int(min(cap, max(MIN_SIGNAL_LEAD_S, math.ceil(need))))
    return lead, (
        f"{SIGNAL_LEAD_FACTOR:g} × (save {timing.seconds:.1f} s at step {timing.step} + step "
        f"{timing.step_seconds:.2f} s) + {SIGNAL_LEAD_SLACK_S} s, within "
        f"[{MIN_SIGNAL_LEAD_S}, {cap}] s"
    )


@dataclass(frozen=True)
class ReserveFor:
    """A reserve job: `count` nodes that join a running job as its spares (a node fault there
    used one up) and run its attempts' ranks when an order names them. Its node tasks act as
    that job's (`worker.task.TrainingTask.reserve_for`): its orders, its attempt's folder, its
    rendezvous port."""

    job_id: str
    seq: int
    count: int
    #: The nodes that run the job's current attempt, in rank order.
    attempt_nodes: tuple[str, ...]
    #: The current attempt's folder for the job (its logs and exit codes).
    job_folder: Path


@dataclass(frozen=True)
class SubmitPlan:
    """One attempt of one run, as the reconciler decided it."""

    run_id: str
    attempt: int
    spec: RunSpec
    checkpoint_dir: Path
    log_dir: Path
    resume_step: int | None = None
    skip_ranges: tuple[tuple[int, int], ...] = ()
    exclude: tuple[str, ...] = ()
    supervisor_url: str | None = None
    worker_token: str | None = None
    stop_at_step: int | None = None
    mtbf_seconds: float | None = None
    metrics: bool = True
    node_setup: NodeSetup = field(default_factory=NodeSetup)
    requeue: bool = False
    signal_delay_s: int = DEFAULT_SIGNAL_LEAD_S
    entry: str = "megatron_runs.train"
    env: dict[str, str] = field(default_factory=dict)
    #: The run's directory, where restart orders for the job are written (None: no restarts
    #: inside the job, whatever the spec says).
    run_dir: Path | None = None
    #: > 0: the job is a successor prepared while the attempt before it stops; its nodes
    #: wait this long for the order that starts the attempt (`worker.task.TrainingTask`).
    standby_wait_s: float = 0.0
    #: Not an attempt's job but a reserve of spares for one (`ReserveFor`).
    reserve: ReserveFor | None = None


#: Every job Nightwatch submits is named `nw-<run id>-a<attempt>`: how a job the database
#: never recorded (a submission cut short) is still found, adopted or cancelled.
JOB_PREFIX = "nw-"


def job_name(run_id: str, attempt: int) -> str:
    return f"{JOB_PREFIX}{run_id}-a{attempt}"


def parse_job_name(name: str) -> tuple[str, int] | None:
    """`job_name`'s inverse: (run id, attempt), or None for a name that is not one of ours."""
    match = re.fullmatch(rf"{re.escape(JOB_PREFIX)}(.+)-a(\d+)", name)
    return (match[1], int(match[2])) if match else None


def reserve_job_name(run_id: str, job_id: str, seq: int) -> str:
    """A reserve job's name: `nw-<run id>-j<job id>-r<seq>`, the `seq`th for job `job_id`."""
    return f"{JOB_PREFIX}{run_id}-j{job_id}-r{seq}"


def parse_reserve_name(name: str) -> tuple[str, str] | None:
    """`reserve_job_name`'s inverse: (run id, the job it reserves for), or None."""
    match = re.fullmatch(rf"{re.escape(JOB_PREFIX)}(.+)-j(\d+)-r\d+", name)
    return (match[1], match[2]) if match else None


def job_env(plan: SubmitPlan) -> dict[str, str]:
    """The job's environment per docs/contracts.md "Worker ↔ supervisor".

    It travels inside the pickled task (set by the worker before anything else runs), not as
    sbatch script lines: the same path works for the local executor, whose `setup` lines would
    put a shell between it and the tasks that swallows their signals.
    """
    env = {
        "NIGHTWATCH_RUN_ID": plan.run_id,
        "NIGHTWATCH_ATTEMPT": str(plan.attempt),
        # One thread per task: CPU ranks share few cores and oversubscription stalls gloo.
        "OMP_NUM_THREADS": str(plan.spec.resources.cpus_per_task),
    }
    if plan.supervisor_url:
        env["NIGHTWATCH_URL"] = plan.supervisor_url
    if plan.worker_token:
        env["NIGHTWATCH_WORKER_TOKEN"] = plan.worker_token
    if plan.spec.resources.device == "cpu":
        # A CPU run trains on CPU even on a GPU node: the training program takes CUDA when it
        # sees any.
        env["CUDA_VISIBLE_DEVICES"] = ""
    return {**env, **plan.env}


def job_request(plan: SubmitPlan) -> JobRequest:
    """sbatch-level request: one task per node, which forks a rank per GPU (processes per node
    on CPU) after importing the training program once (`worker.ranks`); the task holds every
    rank's CPUs."""
    res = plan.spec.resources
    exclude = tuple(sorted({*res.exclude, *plan.exclude}))
    reserve = plan.reserve
    return JobRequest(
        job_name=reserve_job_name(plan.run_id, reserve.job_id, reserve.seq)
        if reserve
        else job_name(plan.run_id, plan.attempt),
        log_dir=plan.log_dir,
        nodes=reserve.count if reserve else res.nodes + res.spare_nodes,
        # spares are taken where free: a job starts once its own nodes are (reserves refill)
        min_nodes=res.nodes if res.spare_nodes and not reserve else None,
        tasks_per_node=1,
        ranks_per_task=res.gpus_per_node,
        cpus_per_task=res.cpus_per_task * res.gpus_per_node,
        gpus_per_node=gpus_required(plan.spec) or None,
        memory_gib=res.memory_gib,
        exclusive=res.exclusive,
        time_limit_minutes=res.time_limit_minutes,
        partition=res.partition,
        account=res.account,
        qos=res.qos,
        exclude=exclude,
        signal_delay_s=plan.signal_delay_s,
        requeue=plan.requeue,
        no_kill=bool(res.spare_nodes),
        python=plan.node_setup.python,
        setup=plan.node_setup.setup,
    )


def gpus_required(spec: RunSpec) -> int:
    """GPUs each node of the job must have: the spec's, on a GPU run; none on a CPU run."""
    res = spec.resources
    return res.gpus_per_node if res.device == "gpu" else 0


def training_task(plan: SubmitPlan) -> TrainingTask:
    """The picklable callable every task of the job runs."""
    return TrainingTask(
        run_id=plan.run_id,
        attempt=plan.attempt,
        spec_json=plan.spec.to_json(),
        checkpoint_dir=str(plan.checkpoint_dir),
        resume_step=plan.resume_step,
        skip_ranges=tuple(plan.skip_ranges),
        stop_at_step=plan.stop_at_step,
        mtbf_seconds=plan.mtbf_seconds,
        metrics=plan.metrics,
        entry=plan.entry,
        env=tuple(sorted(job_env(plan).items())),
        ranks_per_task=plan.spec.resources.gpus_per_node,
        gpus_required=gpus_required(plan.spec),
        signal_lead_s=float(plan.signal_delay_s),
        **_restart_fields(plan),
    )


def _restart_fields(plan: SubmitPlan) -> dict[str, Any]:
    """Where the job's node tasks look for restart orders, and how long they wait for one."""
    rc = plan.spec.recovery
    if plan.run_dir is None or not rc.restart_in_job:
        return {}
    spares = plan.spec.resources.spare_nodes
    fields = {
        "run_dir": str(plan.run_dir),
        "restart_wait_s": rc.restart_wait_seconds,
        "active_nodes": plan.spec.resources.nodes if spares else 0,
        "memory_tier": plan.spec.checkpoint.in_memory,
        "standby": plan.standby_wait_s > 0,
        "standby_wait_s": plan.standby_wait_s,
    }
    if plan.reserve is not None:
        fields.update(
            reserve_for=plan.reserve.job_id,
            nodes=plan.reserve.attempt_nodes,
            job_folder=str(plan.reserve.job_folder),
        )
    return fields


def submit(cluster: Cluster, plan: SubmitPlan) -> Submission:
    """Submit one attempt; the caller records job_id on the attempt."""
    return cluster.submit(job_request(plan), training_task(plan))
