"""`LocalCluster`: the `Cluster` protocol over submitit's LocalExecutor, one node, no SLURM.

The embedded default when no controller answers (`connect.make_cluster`). State lives in this
process (the jobs are its children). There is no scheduler, so draining and requeueing are
unsupported; a preemption signal is delivered as TERM, which submitit's local controller
forwards to every task (the trainer treats USR2 and TERM alike).
"""

from __future__ import annotations

import contextlib
import signal as _signal
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
import submitit

from contracts import exitcodes
from contracts.restart import read_exit_codes
from supervisor.slurm.files import job_log_files, private_submission
from supervisor.slurm.types import (
    JobRequest,
    JobState,
    JobStatus,
    LiveJob,
    NodeInfo,
    NodeState,
    Submission,
    Unsupported,
)

#: How long a local cancel waits for the killed processes to be gone.
CANCEL_WAIT_S = 5.0


class LocalCluster:
    """One node, N processes, through submitit's LocalExecutor (no SLURM on the machine)."""

    kind = "local"

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[submitit.local.local.LocalJob, Path]] = {}
        self._names: dict[str, str] = {}
        self._tasks: dict[str, int] = {}
        self._cancelled: set[str] = set()

    def submit(self, request: JobRequest, fn: Callable[[], object]) -> Submission:
        if request.nodes != 1:
            raise Unsupported(f"the local executor runs one node, not {request.nodes}")
        executor = submitit.LocalExecutor(folder=request.log_dir / "%j")
        executor.update_parameters(
            tasks_per_node=request.tasks_per_node,
            timeout_min=request.time_limit_minutes,
            signal_delay_s=request.signal_delay_s,
            stderr_to_stdout=True,
        )
        with private_submission(request.log_dir):
            job = executor.submit(fn)
        self._jobs[job.job_id] = (job, request.log_dir / job.job_id)
        self._names[job.job_id] = request.job_name
        self._tasks[job.job_id] = request.tasks_per_node * request.ranks_per_task
        return Submission(job_id=job.job_id, log_dir=request.log_dir / job.job_id)

    def poll(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        return {j: self._status(j) for j in job_ids}

    def _status(self, job_id: str) -> JobStatus:
        entry = self._jobs.get(job_id)
        process = getattr(entry[0], "_process", None) if entry else None
        if entry is None or process is None:
            return JobStatus(job_id=job_id, state=JobState.UNKNOWN)
        node = socket.gethostname()
        if process.poll() is None:
            return JobStatus(job_id=job_id, state=JobState.RUNNING, nodes=(node,))
        if job_id in self._cancelled:
            return JobStatus(job_id, JobState.CANCELLED, (node,), reason="cancelled")
        # submitit's local controller exits 0 whatever its tasks did: read the worker's records.
        codes = [code for _, code in read_exit_codes(entry[1], job_id)]
        code = task_exit_code(codes, self._tasks[job_id])
        if code is None:
            return JobStatus(job_id, JobState.FAILED, (node,), reason="task killed")
        state = JobState.COMPLETED if code == 0 else JobState.FAILED
        return JobStatus(job_id, state, (node,), exit_code=code, exit_signal=0)

    def find_jobs(self, job_name: str) -> list[str]:
        """Always []: the local executor keeps no queue to search by name. A job of this
        process is known by the folder submitit made for it (`<log_dir>/<job id>`), which the
        actuator reads next; one of an earlier process died with it or is out of reach."""
        return []

    def finish_submission(self, job_id: str, log_dir: Path) -> bool:
        """Always False: submitit writes a local job's pickle before it starts the job, so no
        local job ever waits for one."""
        return False

    def cancel(self, job_id: str) -> None:
        """Kill the tasks and their controller, as scancel's SIGKILL would.

        Not submitit's cancel: that is a SIGINT to the controller, and a supervisor started
        with SIGINT ignored (any job a shell puts in the background) passes that on to its
        children. The tasks would then train on beside the next attempt, and their checkpoint
        saves collide."""
        entry = self._jobs.get(job_id)
        if entry is None:
            return
        self._cancelled.add(job_id)
        process = getattr(entry[0], "_process", None)
        if process is None or process.poll() is not None:
            return
        try:
            procs = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        process.kill()
        psutil.wait_procs(procs, timeout=CANCEL_WAIT_S)
        with contextlib.suppress(subprocess.TimeoutExpired):  # then poll() says RUNNING still
            process.wait(timeout=CANCEL_WAIT_S)

    def live_jobs(self, prefix: str) -> dict[str, LiveJob]:
        """This process's running jobs named `prefix…` (a local job dies with its supervisor
        only if its process group is killed; one left by an earlier process is not seen)."""
        out = {}
        for job_id, name in self._names.items():
            if not name.startswith(prefix):
                continue
            status = self._status(job_id)
            if status.state is JobState.RUNNING:
                out[job_id] = LiveJob(name, status.nodes)
        return out

    def requeue(self, job_id: str) -> None:
        raise Unsupported("the local executor cannot requeue; resubmit instead")

    def signal(self, job_id: str, sig: str = "USR2") -> None:
        entry = self._jobs.get(job_id)
        process = getattr(entry[0], "_process", None) if entry else None
        if process is not None:
            process.send_signal(_signal.SIGTERM)

    def drain(self, node: str, reason: str) -> None:
        raise Unsupported("the local executor has a single node")

    def resume_node(self, node: str) -> None:
        raise Unsupported("the local executor has a single node")

    def nodes(self) -> dict[str, NodeInfo]:
        busy = any(self._status(j).state is JobState.RUNNING for j in self._jobs)
        name = socket.gethostname()
        return {name: NodeInfo(name=name, state=NodeState.ALLOCATED if busy else NodeState.IDLE)}

    def log_files(self, job_id: str, log_dir: Path | None = None) -> list[Path]:
        entry = self._jobs.get(job_id)
        return job_log_files(log_dir or (entry[1] if entry else None), job_id)


def task_exit_code(codes: Sequence[int], tasks: int) -> int | None:
    """One job code from its tasks' codes: an error beats a requeue beats success.

    None when some task left no code (killed by a signal before it could write one).
    """
    if len(codes) < tasks:
        return None
    errors = [c for c in codes if c not in exitcodes.CLEAN_EXITS]
    if errors:
        return max(errors)
    return exitcodes.REQUEUE if exitcodes.REQUEUE in codes else exitcodes.OK
