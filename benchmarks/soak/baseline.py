"""The naive baseline: what a team runs without Nightwatch, under the same fault schedule.

One sbatch script: `--requeue` (SLURM puts the job back after a node failure or preemption),
`--signal=USR2@90` (the trainer checkpoints before the walltime), the same training program
resuming from the newest complete checkpoint, and `scontrol requeue` of itself when the
program exits non-zero (a crash or a checkpointed stop). No metrics are watched: a loss spike,
NaN gradients, a hang or a slow node are not seen, and nodes are never excluded.

The same script without faults is the fault-free reference run. It depends on the spec
alone, so a later soak of the same spec may reuse it (`load_reference`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.soak.driver import SystemRun, drive, end_time, with_struck_nodes
from benchmarks.soak.faults import Injector, JobView
from benchmarks.soak.progress import LogFollower
from benchmarks.soak.reference import ReferencePlan, Segment
from benchmarks.soak.schedule import Schedule
from benchmarks.soak.score import Remedy, pace_s
from benchmarks.soak.services import PYTHON, REPO, Cluster
from supervisor.slurm import JobState, SlurmCluster, SourceUnavailable

#: No step for this long is a stall nothing in the baseline can end (a SLURM requeue after a
#: node failure takes 42-56 s here; a hang holds until gloo's timeout).
STALL_S = 300.0
#: Nightwatch's workers take 20000-29999 (worker.env.master_port); stay clear of them.
MASTER_PORT_BASE = 30000


def sbatch_script(
    spec: dict[str, Any],
    spec_path: Path,
    work: Path,
    run_id: str,
    train_args: Sequence[str] = (),
) -> str:
    """The job script (pure): requeue on failure, resume from `latest` (or as `train_args`
    say), one task per rank."""
    res = spec.get("resources", {})
    nodes, per_node = int(res.get("nodes", 1)), int(res.get("gpus_per_node", 1))
    cpus = int(res.get("cpus_per_task", 1))
    minutes = int(res.get("time_limit_minutes", 60))
    # A CPU run trains on CPU on a GPU host too (the training program takes CUDA when it sees
    # any), as Nightwatch's launcher has it (`supervisor.launcher`).
    hide_gpus = " CUDA_VISIBLE_DEVICES=" if res.get("device") == "cpu" else ""
    train = " ".join(
        [
            shlex.quote(PYTHON), "-m", "megatron_runs.train",
            "--spec", shlex.quote(str(spec_path)),
            "--run-id", shlex.quote(run_id),
            "--checkpoint-dir", shlex.quote(str(work / "checkpoints")),
            '--attempt "$SLURM_RESTART_COUNT"',
            *(shlex.quote(a) for a in train_args),
        ]
    )  # fmt: skip
    rank_env = (
        "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS "
        "LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE MASTER_ADDR=$SLURM_LAUNCH_NODE_IPADDR; "
        f"exec {train}"
    )
    return f"""#!/bin/bash
#SBATCH --job-name=baseline-{run_id}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={per_node}
#SBATCH --cpus-per-task={cpus}
#SBATCH --time={minutes}
#SBATCH --requeue
#SBATCH --signal=USR2@90
#SBATCH --open-mode=append
#SBATCH --output={work}/logs/batch_%j.out
export SLURM_RESTART_COUNT=${{SLURM_RESTART_COUNT:-0}}
export MASTER_PORT=$(( {MASTER_PORT_BASE} + (SLURM_JOB_ID * 8 + SLURM_RESTART_COUNT) % 10000 ))
export OMP_NUM_THREADS={cpus} PYTHONPATH={shlex.quote(str(REPO))}{hide_gpus}
cd {shlex.quote(str(REPO))}
srun --kill-on-bad-exit=1 --open-mode=append --output={work}/logs/%j_%t_log.out \\
  bash -c {shlex.quote(rank_env)}
rc=$?
echo "training exited $rc (restart $SLURM_RESTART_COUNT)"
if [ "$rc" -ne 0 ]; then
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
"""


def submit(cluster: Cluster, script: Path, home: Path) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        env={**os.environ, **cluster.env, "NIGHTWATCH_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        raise RuntimeError(f"sbatch: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def run_baseline(
    spec: dict[str, Any],
    schedule: Schedule | None,
    cluster: Cluster,
    work: Path,
    home: Path,
    budget_s: float,
    say: Callable[[str], None],
    system: str = "baseline",
    train_args: Sequence[str] = (),
) -> SystemRun:
    (work / "logs").mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    script = work / "job.sbatch"
    script.write_text(sbatch_script(spec, spec_path, work, system, train_args))
    slurm = SlurmCluster(cluster.slurm_conf)
    injector = Injector(cluster, requeueable=True)
    submit_t = time.time()
    job_id = submit(cluster, script, home)
    say(f"{system} job {job_id}")
    follower = LogFollower(work / "logs", "*_0_log.out")
    status: dict[str, Any] = {}

    def poll() -> None:
        # slurmctld may be down on purpose: keep the last answer
        with contextlib.suppress(SourceUnavailable):
            status["job"] = slurm.poll([job_id])[job_id]

    def current_job() -> JobView:
        poll()
        job = status.get("job")
        return JobView(job_id, job.nodes if job else (), work / "checkpoints")

    def finished() -> str | None:
        poll()
        job = status.get("job")
        if job is None or not job.state.terminal or job.state is JobState.UNKNOWN:
            return None
        return job.state.value.lower()

    faults = list(schedule.faults) if schedule else []
    try:
        injections, state = drive(
            faults,
            follower,
            current_job,
            finished,
            injector,
            submit_t + budget_s,
            say,
            stall_s=STALL_S,
        )
        injections = with_struck_nodes(injections, work / "checkpoints")
    finally:
        subprocess.run(
            ["scancel", job_id], env={**os.environ, **cluster.env}, capture_output=True, timeout=30
        )
        injector.revive_all()
    progress = follower.poll()
    target = int(spec["training"]["train_steps"])
    # stalled: it would have waited out its budget (see `drive`)
    gave_up = submit_t + budget_s if state == "stalled" else time.time()
    restarts = [Remedy(s.t, "requeue") for s in progress.starts[1:]]
    return SystemRun(
        system=system,
        submit_t=submit_t,
        end_t=end_time(progress, target, gave_up),
        target_steps=target,
        progress=progress,
        injections=injections,
        remedies=restarts,
        final_state=state,
        extra={"job_id": job_id},
    )


#: The pace run: how many steps it trains and the most it may take.
PACE_STEPS, PACE_BUDGET_S = 200, 600.0


class PaceError(RuntimeError):
    """The pace run did not train its steps: no pace to size the soak by."""


def measure_pace(
    spec: dict[str, Any],
    cluster: Cluster,
    work: Path,
    home: Path,
    say: Callable[[str], None],
) -> float:
    """Seconds per step of `spec`'s job on this machine, saves included (`pace_s` over
    checkpoint intervals, as the scores read it): `spec`, a short clean run (PACE_STEPS),
    trained by the baseline's script, at the reference's pace. A VM's step time varies
    threefold between days, so a soak's `--minutes` is turned into steps by this, not by a
    figure from another day."""
    run = run_baseline(spec, None, cluster, work, home, PACE_BUDGET_S, say, "pace")
    pace = pace_s(run.progress, int(spec["checkpoint"]["interval_steps"]))
    if run.progress.max_step < run.target_steps or pace is None:
        raise PaceError(
            f"the pace run stopped at step {run.progress.max_step} of {run.target_steps} "
            f"({run.final_state}; logs in {work / 'logs'})"
        )
    return pace


#: What a reference run keeps beside its logs, so that a later soak can reuse it.
REFERENCE_RECORD = "run.json"


class ReferenceMismatch(ValueError):
    """The earlier reference was trained on another spec: its times and losses say nothing."""


def run_reference(
    spec: dict[str, Any],
    plan: ReferencePlan,
    cluster: Cluster,
    work: Path,
    home: Path,
    budget_s: float,
    say: Callable[[str], None],
) -> SystemRun:
    """The exact reference (`reference.plan`): the baseline's script without its faults but
    for the plan's data faults, one job per segment, each resuming where the last stopped."""
    ref_spec = {**spec, "faults": list(plan.faults)}
    parts: list[SystemRun] = []
    for i, seg in enumerate(plan.segments):
        last = i == len(plan.segments) - 1
        part = run_baseline(
            ref_spec, None, cluster, work, home, budget_s, say, "reference", seg.train_args(last)
        )
        parts.append(part)
        if part.progress.max_step < seg.stop_step:
            say(f"reference segment {seg} stopped at step {part.progress.max_step}")
            break
    return SystemRun(
        system="reference", submit_t=parts[0].submit_t, end_t=parts[-1].end_t,
        target_steps=parts[-1].target_steps, progress=parts[-1].progress, injections=[],
        final_state=parts[-1].final_state,
        extra={"plan": plan.to_dict(), "jobs": [p.extra.get("job_id") for p in parts]},
    )  # fmt: skip


def save_reference(run: SystemRun, work: Path) -> None:
    record = {"submit_t": run.submit_t, "end_t": run.end_t, "plan": run.extra.get("plan")}
    (work / REFERENCE_RECORD).write_text(json.dumps(record))


def load_reference(
    work: Path, spec: dict[str, Any], plan: ReferencePlan | None = None
) -> SystemRun:
    """An earlier soak's reference run of the same spec (its `spec.json` must match, but for
    the supervisor's `recovery` settings and the checkpoints' retention) and, when given,
    the same plan (segments, skips and data faults), read from its logs.
    Without its record (soaks before it was kept), the submission time is the birth time of
    the job's output file, which slurmd creates as the job starts (0.5 s after the submission
    where this was first needed): a little late, so the reference looks faster and
    Nightwatch's ETTR against it lower, never higher."""
    wanted = spec if plan is None else {**spec, "faults": list(plan.faults)}
    if _trained(json.loads((work / "spec.json").read_text())) != _trained(wanted):
        raise ReferenceMismatch(f"{work / 'spec.json'} is not this soak's reference spec")
    if plan is not None:
        record = _record(work)
        clean = ReferencePlan((Segment(0, int(spec["training"]["train_steps"])),))
        if (record.get("plan") or clean.to_dict()) != plan.to_dict():
            raise ReferenceMismatch(f"the reference in {work} trained another plan")
    progress = LogFollower(work / "logs", "*_0_log.out").poll()
    target = int(spec["training"]["train_steps"])
    record = _record(work)
    if record:
        submit_t, end_t = float(record["submit_t"]), float(record["end_t"])
    else:
        submit_t = _birth_time(next(iter(sorted((work / "logs").glob("batch_*.out"))), None))
        end_t = end_time(progress, target, max(e.t for e in progress.steps))
    if progress.max_step < target:
        raise ReferenceMismatch(f"the reference in {work} stopped at step {progress.max_step}")
    return SystemRun(
        system="reference", submit_t=submit_t, end_t=end_t, target_steps=target,
        progress=progress, injections=[], final_state="reused", extra={"reused_from": str(work)},
    )  # fmt: skip


def _record(work: Path) -> dict[str, Any]:
    path = work / REFERENCE_RECORD
    return json.loads(path.read_text()) if path.exists() else {}


#: Checkpoint settings that decide only which saves are kept, never what is trained.
RETENTION = ("keep_last", "keep_seconds")


def _trained(spec: dict[str, Any]) -> dict[str, Any]:
    """What decides the training a spec makes: all but the supervisor's `recovery` and the
    checkpoints' retention (the same steps, samples and losses either way)."""
    out = {k: v for k, v in spec.items() if k != "recovery"}
    if "checkpoint" in out:
        out["checkpoint"] = {k: v for k, v in out["checkpoint"].items() if k not in RETENTION}
    return out


def _birth_time(path: Path | None) -> float:
    """A file's creation time (statx via GNU stat; Python's os.stat has none on Linux)."""
    if path is None:
        raise ReferenceMismatch("the reference holds no job output to date its submission")
    out = subprocess.run(["stat", "-c", "%W", str(path)], capture_output=True, text=True)
    born = float(out.stdout.strip() or 0)
    if out.returncode != 0 or born <= 0:
        raise ReferenceMismatch(f"{path}: this file system keeps no creation time")
    return born
