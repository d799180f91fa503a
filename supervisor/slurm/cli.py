"""`SlurmCluster`: the `Cluster` protocol over SLURM's tools (submitit and sbatch to submit;
squeue, sacct, sinfo, scontrol and scancel for the rest).

Why it is shaped like this: the supervisor must never mistake "I could not ask" for "the job is
gone" (DESIGN rule 1), so every subprocess has a timeout and a failed query raises
`SourceUnavailable`. State comes from one batched `squeue` per tick for all jobs (sacct only
for jobs the controller has forgotten), parsed by the pure functions of `parse`.
submitit is used only to submit (pickling the worker), never for state, because it caches
NODE_FAIL as final and swallows sacct errors. Jobs are submitted with `--no-requeue` unless the
plan asks otherwise, so SLURM does not silently restart a job whose node failed: the supervisor
decides.
"""

from __future__ import annotations

import getpass
import logging
import os
import shlex
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import submitit

from contracts.slurm_names import check_job_name, check_node_name, check_slurm_name
from supervisor.slurm.files import job_log_files, private_submission
from supervisor.slurm.parse import (
    SACCT_FIELDS,
    SQUEUE_FORMAT,
    job_sort_key,
    parse_job_ids,
    parse_live_jobs,
    parse_sacct,
    parse_sinfo,
    parse_squeue,
    with_failed_nodes,
)
from supervisor.slurm.types import (
    InvalidRequest,
    JobRequest,
    JobState,
    JobStatus,
    LiveJob,
    NodeInfo,
    SourceUnavailable,
    Submission,
)

log = logging.getLogger("nightwatch.slurm")

DEFAULT_TIMEOUT_S = 10.0


def _checked(check: Callable[[str], str], value: str) -> str:
    try:
        return check(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


class SlurmCluster:
    """A real SLURM cluster reached through its command-line tools."""

    kind = "slurm"

    def __init__(self, slurm_conf: str | Path | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.env = dict(os.environ)
        if slurm_conf:
            # submitit runs sbatch with this process's environment; one cluster per process.
            os.environ["SLURM_CONF"] = str(slurm_conf)
            self.env["SLURM_CONF"] = str(slurm_conf)
        self.calls = 0

    def _run(self, cmd: list[str]) -> str:
        self.calls += 1
        try:
            out = subprocess.run(
                cmd, env=self.env, capture_output=True, text=True, timeout=self.timeout_s
            )
        except (subprocess.TimeoutExpired, OSError) as exc:
            raise SourceUnavailable(f"{cmd[0]}: {exc}") from exc
        if out.returncode != 0:
            raise SourceUnavailable(
                f"{shlex.join(cmd)} exited {out.returncode}: {out.stderr[-500:]}"
            )
        return out.stdout

    def submit(self, request: JobRequest, fn: Callable[[], object]) -> Submission:
        executor = slurm_executor(request)
        try:
            with private_submission(request.log_dir):
                job = executor.submit(fn)
        except (subprocess.SubprocessError, OSError, submitit.core.utils.FailedJobError) as exc:
            raise SourceUnavailable(f"sbatch failed: {exc}") from exc
        log.info("submitted", extra={"job_id": job.job_id})
        return Submission(job_id=str(job.job_id), log_dir=request.log_dir / str(job.job_id))

    def poll(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        """One squeue call for every job the controller still holds (all active ones).

        Jobs it no longer holds (finished more than MinJobAge ago) are asked of sacct in one
        more call; a job neither knows is UNKNOWN, never gone. sacct is not the primary source
        because slurmdbd lags: a freshly submitted job is missing there for a while, and its
        node list lags behind the controller's. One sinfo call names the failed node(s) when
        some job hit NODE_FAIL.

        A COMPLETING job is asked of sacct too: squeue shows only that flag, and only the nodes
        still cleaning up, while sacct already has the ending and the whole allocation. A
        NODE_FAIL is taken from there at once (its cure needs no log, and tearing down the
        lost node's peers took 26 s in the soak); other endings wait for the teardown, whose
        logs the crash blame reads.
        """
        if not job_ids:
            return {}
        ids = ",".join(job_ids)
        seen = parse_squeue(
            self._run_squeue(["squeue", "-h", "-t", "all", "-j", ids, "-O", SQUEUE_FORMAT])
        )
        missing = [j for j in job_ids if j not in seen]
        completing = [j for j, st in seen.items() if st.completing]
        if missing or completing:
            accounted = parse_sacct(
                self._run(
                    [
                        "sacct",
                        "-X",
                        "-P",
                        "-n",
                        "-j",
                        ",".join(missing + completing),
                        "-o",
                        ",".join(SACCT_FIELDS),
                    ]
                )
            )
            seen.update(
                {
                    j: st
                    for j, st in accounted.items()
                    if j in missing or (j in completing and st.state is JobState.NODE_FAIL)
                }
            )
        statuses = {j: seen.get(j, JobStatus(job_id=j, state=JobState.UNKNOWN)) for j in job_ids}
        if any(s.state is JobState.NODE_FAIL for s in statuses.values()):
            statuses = with_failed_nodes(statuses, self.nodes())
        return statuses

    def find_jobs(self, job_name: str) -> list[str]:
        """Ids of the jobs named `job_name` (oldest first), so a submit interrupted by a crash is
        found instead of repeated.

        squeue answers for jobs the controller holds; sacct for jobs it has forgotten (or when
        squeue fails). Both failing raises `SourceUnavailable`: "none found" is only ever said
        by a source that answered.
        """
        _checked(check_job_name, job_name)
        ids: set[str] = set()
        try:
            ids.update(
                parse_job_ids(
                    self._run(["squeue", "-h", "-t", "all", "-o", "%i", "--name", job_name])
                )
            )
        except SourceUnavailable as exc:
            squeue_error: SourceUnavailable | None = exc
        else:
            squeue_error = None
            if ids:
                return sorted(ids, key=job_sort_key)
        try:
            out = self._run(
                ["sacct", "-X", "-P", "-n", "-S", "now-7days", "--name", job_name, "-o", "JobIDRaw"]
            )
        except SourceUnavailable:
            if squeue_error is not None:
                raise
            return []
        ids.update(parse_job_ids(out))
        return sorted(ids, key=job_sort_key)

    def live_jobs(self, prefix: str) -> dict[str, LiveJob]:
        """This user's jobs still queued or running whose name starts with `prefix`: id →
        name and nodes, in one squeue call (the reconciler's sweep for jobs no run may have)."""
        out = self._run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%i|%j|%T|%N"])
        return parse_live_jobs(out, prefix)

    def finish_submission(self, job_id: str, log_dir: Path) -> bool:
        """Finish a submission cut short after sbatch accepted it: the supervisor died before
        submitit moved the job's pickle from `log_dir` into `<job id>/`, and the job, adopted
        by `find_jobs`, would wait 60 s for it and fail like a program error. The attempt's
        newest orphan pickle is that job's (a job found by name is never submitted again, so
        older orphans are from sbatch calls that never got a job). True when it was moved."""
        paths = submitit.core.utils.JobPaths(log_dir / "%j", job_id=job_id)
        if paths.submitted_pickle.exists():
            return False
        orphans = sorted(log_dir.glob("*.pkl"), key=lambda p: p.stat().st_mtime)
        if not orphans:
            return False
        paths.folder.mkdir(parents=True, exist_ok=True)
        os.replace(orphans[-1], paths.submitted_pickle)
        return True

    def _run_squeue(self, cmd: list[str]) -> str:
        """squeue fails on a single id it no longer knows; that is "no line", not an outage."""
        try:
            return self._run(cmd)
        except SourceUnavailable as exc:
            if "Invalid job id" in str(exc):
                return ""
            raise

    def cancel(self, job_id: str) -> None:
        self._run(["scancel", job_id])

    def requeue(self, job_id: str) -> None:
        """Only for jobs submitted with `requeue=True`; the others are resubmitted instead."""
        self._run(["scontrol", "requeue", job_id])

    def signal(self, job_id: str, sig: str = "USR2") -> None:
        """Signal every task of every step (not the batch shell: it would kill srun)."""
        self._run(["scancel", f"--signal={sig}", job_id])

    def drain(self, node: str, reason: str) -> None:
        _checked(check_node_name, node)
        self._run(["scontrol", "update", f"nodename={node}", "state=DRAIN", f"reason={reason}"])

    def resume_node(self, node: str) -> None:
        _checked(check_node_name, node)
        self._run(["scontrol", "update", f"nodename={node}", "state=RESUME"])

    def nodes(self) -> dict[str, NodeInfo]:
        return parse_sinfo(self._run(["sinfo", "-h", "-N", "-o", "%N|%t|%E"]))

    def log_files(self, job_id: str, log_dir: Path | None = None) -> list[Path]:
        return job_log_files(log_dir, job_id)


def slurm_executor(request: JobRequest) -> submitit.SlurmExecutor:
    """The submitit executor of one request (no I/O until it submits)."""
    executor = submitit.SlurmExecutor(folder=request.log_dir / "%j", python=request.python)
    executor.update_parameters(**sbatch_parameters(request))
    return executor


def render_sbatch(request: JobRequest) -> str:
    """The batch script sbatch would be given for this request, without submitting it."""
    executor = slurm_executor(request)
    # submitit has no public render; this is the text its `submit` writes and hands to sbatch
    # (`%j` in the paths is sbatch's, filled in at submission).
    return executor._make_submission_file_text(executor._submitit_command_str, "dry-run")


def sbatch_parameters(request: JobRequest) -> dict[str, object]:
    """submitit SlurmExecutor parameters for a request (pure; tested without SLURM).

    Every string here becomes an `#SBATCH` line of a bash script, so each is checked against
    its pattern (`contracts.slurm_names`) whatever checked it before: InvalidRequest otherwise.
    """
    additional: dict[str, object] = {"requeue" if request.requeue else "no-requeue": True}
    if request.no_kill:
        additional["no-kill"] = True
    # A node range: as many nodes as are free, at least the minimum. A stated task count per
    # node makes SLURM size the job to the minimum, so a range goes without it (one task per
    # node is SLURM's default); submitit counts the job's tasks from `nodes`, sbatch reads the
    # range.
    ranged = request.min_nodes is not None and request.min_nodes < request.nodes
    ranged = ranged and request.tasks_per_node == 1
    if ranged:
        additional["nodes"] = f"{request.min_nodes}-{request.nodes}"
    params: dict[str, object] = {
        "job_name": _checked(check_job_name, request.job_name),
        "nodes": request.nodes,
        "ntasks_per_node": request.tasks_per_node,
        "cpus_per_task": request.cpus_per_task,
        "time": request.time_limit_minutes,
        "signal_delay_s": request.signal_delay_s,
        "stderr_to_stdout": True,
        "additional_parameters": additional,
    }
    if ranged:
        del params["ntasks_per_node"]
    if request.no_kill:
        params["srun_args"] = ["--no-kill"]
    if request.gpus_per_node:
        params["gpus_per_node"] = request.gpus_per_node
    if request.memory_gib:
        params["mem"] = f"{request.memory_gib}G"
    if request.exclusive:
        params["exclusive"] = True
    if request.setup:
        params["setup"] = list(request.setup)
    for name in ("partition", "account", "qos"):
        value = getattr(request, name)
        if value:
            params[name] = _checked(check_slurm_name, value)
    if request.exclude:
        params["exclude"] = ",".join(_checked(check_node_name, n) for n in request.exclude)
    return params


def detect_slurm(slurm_conf: str | Path | None = None, timeout_s: float = 3.0) -> bool:
    """True when a controller answers `scontrol ping` (srun on PATH alone proves nothing)."""
    env = dict(os.environ)
    if slurm_conf:
        env["SLURM_CONF"] = str(slurm_conf)
    try:
        out = subprocess.run(
            ["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except (subprocess.TimeoutExpired, OSError):
        return False
    return out.returncode == 0 and "UP" in out.stdout
