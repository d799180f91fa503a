"""The one module that talks to SLURM (submitit, sbatch, squeue, sacct, sinfo, scontrol, scancel).

Why it is shaped like this: the supervisor must never mistake "I could not ask" for "the job is
gone" (DESIGN rule 1), so every subprocess has a timeout and a failed query raises
`SourceUnavailable`. State comes from one batched `squeue` per tick for all jobs (sacct only
for jobs the controller has forgotten), parsed by pure functions tested on captured text.
submitit is used only to submit (pickling the worker), never for state, because it caches
NODE_FAIL as final and swallows sacct errors. Jobs are submitted with `--no-requeue` unless the
plan asks otherwise, so SLURM does not silently restart a job whose node failed: the supervisor
decides. `LocalCluster` is the same interface over submitit's LocalExecutor (one node), the
embedded default when no SLURM cluster answers.
"""

from __future__ import annotations

import contextlib
import enum
import getpass
import logging
import os
import re
import shlex
import signal as _signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil
import submitit

from contracts import exitcodes
from contracts.slurm_names import check_job_name, check_node_name, check_slurm_name

log = logging.getLogger("nightwatch.slurm")

DEFAULT_TIMEOUT_S = 10.0
#: How long a local cancel waits for the killed processes to be gone.
CANCEL_WAIT_S = 5.0


class SourceUnavailable(RuntimeError):
    """SLURM could not be asked (timeout, daemon down, bad output): state unknown, not gone."""


class Unsupported(RuntimeError):
    """The cluster kind cannot do this (e.g. draining a node of the local executor)."""


class InvalidRequest(Unsupported):
    """A string bound for sbatch or scontrol breaks its pattern (`contracts.slurm_names`):
    never sent. The spec refuses such strings; this guards anything stored before it did."""


def _checked(check: Callable[[str], str], value: str) -> str:
    try:
        return check(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


class JobState(enum.StrEnum):
    """How SLURM sees a job; the attempt's outcome is derived from it.

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


_ACTIVE = frozenset({JobState.PENDING, JobState.RUNNING, JobState.REQUEUED, JobState.UNKNOWN})

_STATE_ALIASES = {
    "COMPLETING": JobState.RUNNING,
    "CONFIGURING": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "REQUEUE_HOLD": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED,
    "RESV_DEL_HOLD": JobState.PENDING,
    "SPECIAL_EXIT": JobState.FAILED,
    "REVOKED": JobState.CANCELLED,
    "OOM": JobState.OUT_OF_MEMORY,
}


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

    @property
    def completing(self) -> bool:
        """SLURM is tearing the job down: its final state is pending, and its node list
        holds only the nodes still cleaning up (a lost node is already gone from it)."""
        return self.raw_state.upper().startswith("COMPLETING")


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str
    reason: str = ""

    @property
    def down(self) -> bool:
        return any(s in self.state for s in ("down", "fail", "not_responding", "*"))

    @property
    def idle(self) -> bool:
        return self.state == "idle"


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
    """What the launcher and the reconciler may ask of a cluster."""

    kind: str

    def submit(self, request: JobRequest, fn: Callable[[], object]) -> Submission: ...

    def poll(self, job_ids: Sequence[str]) -> dict[str, JobStatus]: ...

    def cancel(self, job_id: str) -> None: ...

    def requeue(self, job_id: str) -> None: ...

    def signal(self, job_id: str, sig: str = "USR2") -> None: ...

    def drain(self, node: str, reason: str) -> None: ...

    def resume_node(self, node: str) -> None: ...

    def nodes(self) -> dict[str, NodeInfo]: ...

    def log_files(self, job_id: str, log_dir: Path | None = None) -> list[Path]: ...


# ------------------------------------------------------------------ pure parsing
def expand_hostlist(text: str) -> list[str]:
    """`n[1-3,5],gpu07` → ['n1','n2','n3','n5','gpu07'] (SLURM's compressed host lists)."""
    text = text.strip()
    if not text or text.startswith("None"):
        return []
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    hosts: list[str] = []
    for part in parts:
        match = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for rng in ranges.split(","):
            lo, _, hi = rng.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo)
            hosts.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1))
    return hosts


def parse_state(raw: str) -> JobState:
    """`CANCELLED by 0` → CANCELLED; unknown words → UNKNOWN (never a guess)."""
    word = raw.strip().split(" ")[0].rstrip("+").upper()
    if word in JobState.__members__:
        return JobState(word)
    return _STATE_ALIASES.get(word, JobState.UNKNOWN)


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """sacct's `code:signal`."""
    code, _, sig = text.strip().partition(":")
    try:
        return int(code), int(sig or 0)
    except ValueError:
        return None, None


SACCT_FIELDS = ("JobIDRaw", "State", "ExitCode", "NodeList", "Reason")


def parse_sacct(text: str) -> dict[str, JobStatus]:
    """Parse `sacct -X -P -n -o JobIDRaw,State,ExitCode,NodeList,Reason`.

    A requeued job may appear more than once (one line per start); the last line wins.
    """
    out: dict[str, JobStatus] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        cols = line.split("|")
        if len(cols) < len(SACCT_FIELDS):
            raise SourceUnavailable(f"unexpected sacct line: {line!r}")
        job_id, raw_state, exit_text, nodelist, reason = cols[: len(SACCT_FIELDS)]
        code, sig = parse_exit_code(exit_text)
        out[job_id] = JobStatus(
            job_id=job_id,
            state=parse_state(raw_state),
            nodes=tuple(expand_hostlist(nodelist)),
            exit_code=code,
            exit_signal=sig,
            reason="" if reason == "None" else reason,
            raw_state=raw_state,
        )
    return out


SQUEUE_FORMAT = "JobID:|,State:|,NodeList:|,Reason:|,exit_code:|"


def parse_squeue(text: str) -> dict[str, JobStatus]:
    """Parse `squeue -h -t all -O JobID:|,State:|,NodeList:|,Reason:|,exit_code:|`.

    squeue's exit_code is the raw wait status: code in the high byte, signal in the low bits.
    """
    out: dict[str, JobStatus] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split("|")]
        if len(cols) < 5:
            raise SourceUnavailable(f"unexpected squeue line: {line!r}")
        job_id, raw_state, nodelist, reason, status = cols[:5]
        try:
            wait_status = int(status)
        except ValueError:
            code, sig = None, None
        else:
            code, sig = wait_status >> 8, wait_status & 0x7F
        out[job_id] = JobStatus(
            job_id=job_id,
            state=parse_state(raw_state),
            nodes=tuple(expand_hostlist(nodelist)),
            exit_code=code,
            exit_signal=sig,
            reason="" if reason == "None" else reason,
            raw_state=raw_state,
        )
    return out


def parse_job_ids(text: str) -> list[str]:
    """One job id per line (`squeue -o %i`, `sacct -o JobIDRaw`); anything else is an error."""
    ids = [line.strip() for line in text.splitlines() if line.strip()]
    bad = [i for i in ids if not re.fullmatch(r"\d+(_\d+)?", i)]
    if bad:
        raise SourceUnavailable(f"unexpected job id(s): {bad[:3]!r}")
    return ids


def parse_live_jobs(text: str, prefix: str) -> dict[str, str]:
    """`squeue -o %i|%j|%T` → {job id: name} of the queued or running jobs named `prefix…`
    (a COMPLETING job is already on its way out)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        job_id, sep, rest = line.strip().partition("|")
        name, sep2, raw_state = rest.rpartition("|")
        if not (sep and sep2) or not re.fullmatch(r"\d+(_\d+)?", job_id):
            raise SourceUnavailable(f"unexpected squeue line: {line!r}")
        if name.startswith(prefix) and raw_state != "COMPLETING" and parse_state(raw_state).active:
            out[job_id] = name
    return out


def _job_sort_key(job_id: str) -> tuple[int, ...]:
    return tuple(int(p) for p in job_id.split("_"))


def parse_sinfo(text: str) -> dict[str, NodeInfo]:
    """Parse `sinfo -h -N -o %N|%t|%E`; a node listed in several partitions appears once."""
    out: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, state, reason = ([*line.split("|", 2), "", ""])[:3]
        out[name] = NodeInfo(name=name, state=state.strip(), reason=reason.strip())
    return out


def with_failed_nodes(
    statuses: dict[str, JobStatus], nodes: dict[str, NodeInfo]
) -> dict[str, JobStatus]:
    """Name the node(s) behind a NODE_FAIL: the job's nodes that SLURM now holds down."""
    out = dict(statuses)
    for job_id, st in statuses.items():
        if st.state is JobState.NODE_FAIL:
            failed = tuple(n for n in st.nodes if n in nodes and nodes[n].down)
            out[job_id] = JobStatus(**{**st.__dict__, "failed_nodes": failed})
    return out


# ------------------------------------------------------------------ SLURM
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
                return sorted(ids, key=_job_sort_key)
        try:
            out = self._run(
                ["sacct", "-X", "-P", "-n", "-S", "now-7days", "--name", job_name, "-o", "JobIDRaw"]
            )
        except SourceUnavailable:
            if squeue_error is not None:
                raise
            return []
        ids.update(parse_job_ids(out))
        return sorted(ids, key=_job_sort_key)

    def live_jobs(self, prefix: str) -> dict[str, str]:
        """This user's jobs still queued or running whose name starts with `prefix`: id →
        name, in one squeue call (the reconciler's sweep for jobs no run may have)."""
        out = self._run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%i|%j|%T"])
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
        return _log_files(log_dir, job_id)


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
    params: dict[str, object] = {
        "job_name": _checked(check_job_name, request.job_name),
        "nodes": request.nodes,
        "ntasks_per_node": request.tasks_per_node,
        "cpus_per_task": request.cpus_per_task,
        "time": request.time_limit_minutes,
        "signal_delay_s": request.signal_delay_s,
        "stderr_to_stdout": True,
        "additional_parameters": {"requeue" if request.requeue else "no-requeue": True},
    }
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


def _log_files(log_dir: Path | None, job_id: str) -> list[Path]:
    if log_dir is None:
        return []
    folder = log_dir if log_dir.name == job_id else log_dir / job_id
    return sorted(folder.glob(f"{job_id}_*_log.out"))


def tail(path: Path, max_bytes: int = 64 * 1024) -> str:
    """The end of a log file (a missing file reads as empty: the job may not have started)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


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


#: Everything a submission creates is the supervisor user's alone (dirs 0700, files 0600).
PRIVATE_UMASK = 0o077
_umask_lock = threading.Lock()


@contextlib.contextmanager
def private_submission(log_dir: Path) -> Iterator[None]:
    """The submission folder, private: submitit's pickles hold the task, and the task holds the
    job's environment, the run's worker token among it.

    `log_dir` is made (or tightened to) 0700, and the umask is 077 while submitit writes its
    pickles and starts the job: sbatch hands that umask to the job (SLURM_UMASK) and a local
    job inherits it, so the job's logs are private too. The umask is process-wide, so other
    threads' files created meanwhile are private as well (never less so); the lock keeps two
    submissions from restoring each other's umask."""
    with _umask_lock:
        previous = os.umask(PRIVATE_UMASK)
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            log_dir.chmod(0o700)
            yield
        finally:
            os.umask(previous)


# ------------------------------------------------------------------ local
class LocalCluster:
    """One node, N processes, through submitit's LocalExecutor (no SLURM on the machine).

    State lives in this process (the jobs are its children). There is no scheduler, so
    drain/requeue are unsupported; a preemption signal is delivered as TERM, which submitit's
    local controller forwards to every task (the trainer treats USR2 and TERM alike).
    """

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
        codes = [int(p.read_text()) for p in entry[1].glob(f"{job_id}_*_exit_code")]
        code = task_exit_code(codes, self._tasks[job_id])
        if code is None:
            return JobStatus(job_id, JobState.FAILED, (node,), reason="task killed")
        state = JobState.COMPLETED if code == 0 else JobState.FAILED
        return JobStatus(job_id, state, (node,), exit_code=code, exit_signal=0)

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

    def live_jobs(self, prefix: str) -> dict[str, str]:
        """This process's running jobs named `prefix…` (a local job dies with its supervisor
        only if its process group is killed; one left by an earlier process is not seen)."""
        return {
            job_id: name
            for job_id, name in self._names.items()
            if name.startswith(prefix) and self._status(job_id).state is JobState.RUNNING
        }

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
        return {name: NodeInfo(name=name, state="alloc" if busy else "idle")}

    def log_files(self, job_id: str, log_dir: Path | None = None) -> list[Path]:
        entry = self._jobs.get(job_id)
        return _log_files(log_dir or (entry[1] if entry else None), job_id)


def task_exit_code(codes: Sequence[int], tasks: int) -> int | None:
    """One job code from its tasks' codes: an error beats a requeue beats success.

    None when some task left no code (killed by a signal before it could write one).
    """
    if len(codes) < tasks:
        return None
    errors = [c for c in codes if c not in (exitcodes.OK, exitcodes.REQUEUE)]
    if errors:
        return max(errors)
    return exitcodes.REQUEUE if exitcodes.REQUEUE in codes else exitcodes.OK


def make_cluster(
    slurm_conf: str | Path | None = None, executor: str = "auto"
) -> SlurmCluster | LocalCluster:
    """`executor` "slurm" or "local" as configured; "auto": SLURM when a controller answers,
    else the embedded local executor."""
    conf = slurm_conf or os.environ.get("SLURM_CONF")
    if executor == "local":
        return LocalCluster()
    if executor == "slurm" or detect_slurm(conf):
        return SlurmCluster(conf)
    return LocalCluster()


def wait_for(
    cluster: Cluster,
    job_id: str,
    until: Callable[[JobStatus], bool],
    timeout_s: float,
    interval_s: float = 0.5,
) -> JobStatus:
    """Poll one job until `until(status)`; for scripts and tests, the reconciler polls itself."""
    deadline = time.monotonic() + timeout_s
    status = JobStatus(job_id=job_id, state=JobState.UNKNOWN)
    while time.monotonic() < deadline:
        try:
            status = cluster.poll([job_id])[job_id]
        except SourceUnavailable:
            status = JobStatus(job_id=job_id, state=JobState.UNKNOWN)
        if until(status):
            return status
        time.sleep(interval_s)
    raise TimeoutError(f"job {job_id} still {status.state} after {timeout_s}s")
