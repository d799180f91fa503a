"""Log text → cause and nodes: the one home of the patterns that read a failed job's log.

Pure: the supervisor tails logs at the edge (`supervisor.slurm.tail`, in `observe`), and this
module turns captured text into findings and blame, so every pattern is tested on recorded logs
without SLURM. The classes are evidence for the policy (a gloo/NCCL error naming a peer
suggests that node; an OOM suggests a smaller micro-batch, not a node swap; an exception
before the first step is a program error).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from contracts import exitcodes
from supervisor.watchdog.snapshot import Cause


class LogKind(enum.StrEnum):
    COLLECTIVE_ERROR = "collective_error"  # NCCL / gloo failure, often naming the peer host
    OUT_OF_MEMORY = "out_of_memory"
    NODE_FAILURE = "node_failure"
    TIME_LIMIT = "time_limit"
    PREEMPTION = "preemption"
    PYTHON_EXCEPTION = "python_exception"
    TASK_EXIT = "task_exit"  # srun: "<node>: task N: Exited with exit code C" (or: Killed)


@dataclass(frozen=True)
class LogFinding:
    kind: LogKind
    line: str
    host: str | None = None
    exit_code: int | None = None
    detail: str = ""


_TASK_EXIT = re.compile(
    r"srun: error: (?P<host>[\w.-]+): tasks? [\d,\-]+: "
    r"(?:Exited with exit code (?P<code>\d+)|Killed|Terminated|Aborted|Segmentation fault|"
    r"User defined signal 2)"
)
_CANCELLED = re.compile(
    r"\*\*\* (?:JOB|STEP) [\d.]+ ON (?P<host>[\w.-]+) CANCELLED AT \S+ (?P<why>.*?)\s*\*\*\*"
)
_PEER = re.compile(
    r"(?:remote peer|peer|remote process on|rank \d+ on|hostname|host)[\s:=]*"
    r"\[?(?P<host>[A-Za-z][\w.-]*|\d+\.\d+\.\d+\.\d+)\]?",
    re.IGNORECASE,
)
_COLLECTIVE = re.compile(
    r"(NCCL (?:error|WARN)|ncclInternalError|ncclSystemError|ncclRemoteError|gloo/transport|"
    r"Gloo connectFullMesh failed|Connection closed by peer|Connection reset by peer|"
    r"DistNetworkError|DistBackendError|ProcessGroupGloo)",
    re.IGNORECASE,
)
_OOM = re.compile(
    r"(CUDA out of memory|OutOfMemoryError|oom[-_]kill|Out Of Memory|Killed process \d+|"
    r"Cannot allocate memory)",
    re.IGNORECASE,
)
_EXCEPTION = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\w*)(?::\s*(?P<msg>.*))?$"
)


def classify(text: str) -> list[LogFinding]:
    """Every recognised line, in order of appearance (tested on captured logs)."""
    findings: list[LogFinding] = []
    lines = text.splitlines()
    in_traceback = False
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        if m := _TASK_EXIT.search(line):
            findings.append(
                LogFinding(
                    LogKind.TASK_EXIT,
                    line,
                    host=m["host"],
                    exit_code=int(m["code"]) if m["code"] else None,  # None: killed by a signal
                )
            )
            continue
        if m := _CANCELLED.search(line):
            why = m["why"].upper()
            kind = (
                LogKind.NODE_FAILURE
                if "NODE FAILURE" in why
                else LogKind.TIME_LIMIT
                if "TIME LIMIT" in why
                else LogKind.PREEMPTION
                if "PREEMPTION" in why
                else None
            )
            if kind:
                findings.append(LogFinding(kind, line, host=m["host"], detail=m["why"]))
            continue
        if _OOM.search(line):
            findings.append(LogFinding(LogKind.OUT_OF_MEMORY, line))
            continue
        if _COLLECTIVE.search(line):
            peer = _PEER.search(line)
            findings.append(
                LogFinding(LogKind.COLLECTIVE_ERROR, line, host=peer["host"] if peer else None)
            )
            continue
        if in_traceback and not raw.startswith((" ", "\t")) and (m := _EXCEPTION.match(line)):
            findings.append(LogFinding(LogKind.PYTHON_EXCEPTION, line, detail=m["type"]))
            in_traceback = False
    return findings


def suspect_hosts(findings: list[LogFinding]) -> list[str]:
    """Hosts named by collective errors or node failures, most-mentioned first."""
    counts: dict[str, int] = {}
    for f in findings:
        if f.host and f.kind in (LogKind.COLLECTIVE_ERROR, LogKind.NODE_FAILURE):
            counts[f.host] = counts.get(f.host, 0) + 1
    return sorted(counts, key=lambda h: (-counts[h], h))


# --- blame of a failed job ----------------------------------------------------------------

LogCause = tuple[Cause | None, str | None, tuple[str, ...]]  # cause, log line, named nodes

#: What a rank logs when a PEER died (gloo/NCCL): the address it names is the reporting
#: side's view of the dead peer (127.0.0.1 on one host), so it blames the rank that crashed.
_PEER_CLOSED = re.compile(r"Connection (?:closed|reset) by peer", re.IGNORECASE)
_IPV4 = re.compile(r"\d+\.\d+\.\d+\.\d+")


def node_names(hosts: Iterable[str], nodes: Sequence[str]) -> tuple[str, ...]:
    """Hosts named in a log as the attempt's SLURM node names (pure): exact or short-name
    match (`gpu13.cluster` → `gpu13`); anything else (an address, a host outside the
    attempt) is dropped, because excluding it makes every resubmission fail with sbatch's
    `Invalid node name specified`."""
    out: list[str] = []
    for host in hosts:
        short = host if _IPV4.fullmatch(host) else host.split(".")[0]
        name = host if host in nodes else short if short in nodes else None
        if name is not None and name not in out:
            out.append(name)
    return tuple(out)


def crashed_hosts(findings: Sequence[LogFinding]) -> list[str]:
    """Hosts of the tasks that died on their own: killed by a signal or exited with a code
    other than 1 (a peer that lost them raises and exits 1); else the first task srun saw end."""
    exits = [f for f in findings if f.kind is LogKind.TASK_EXIT and f.host]
    own = [f for f in exits if f.exit_code not in (0, 1)]
    return list(dict.fromkeys(f.host for f in own or exits[:1] if f.host))


def log_cause(
    text: str, exit_code: int | None, made_progress: bool, nodes: Sequence[str] = ()
) -> LogCause:
    """Blame from a failed job's log (pure), naming only the attempt's nodes (`nodes`):
    collective errors name a faulty node; a peer's "connection closed" and a killed or
    crashed rank are a plain crash of that rank's node (restart, exclusion only when it
    recurs there); an exception before the first step is a program error."""
    findings = classify(text)
    kinds = {f.kind for f in findings}
    first = findings[-1].line if findings else None
    crashed = node_names(crashed_hosts(findings), nodes)
    if exit_code == exitcodes.REQUEUE or any(
        f.kind is LogKind.TASK_EXIT and _STOP_WARNING.search(f.line) for f in findings
    ):
        # Checkpointed on a stop signal, or killed by SLURM's USR2 warning (walltime or
        # preemption) before its handler was in place: the stop is nobody's fault.
        return Cause.INFRA, first, ()
    collective = {LogKind.COLLECTIVE_ERROR, LogKind.NODE_FAILURE}
    peer_lost = any(f.kind in collective and _PEER_CLOSED.search(f.line) for f in findings)
    blaming = [f for f in findings if f.kind in collective and not _PEER_CLOSED.search(f.line)]
    if blaming:
        return Cause.NODE, first, node_names(suspect_hosts(blaming), nodes)
    if LogKind.OUT_OF_MEMORY in kinds:
        return Cause.CODE, first, ()
    if peer_lost or exit_code == exitcodes.INJECTED_CRASH:
        return Cause.UNKNOWN, first, crashed
    if LogKind.PYTHON_EXCEPTION in kinds and not made_progress:
        return Cause.CODE, first, ()
    return Cause.UNKNOWN if findings else None, first, crashed


#: A task that SLURM's stop warning (`--signal=USR2@lead`) killed before it could handle it.
_STOP_WARNING = re.compile(r"User defined signal 2")

_NODE_PATTERNS = re.compile(
    r"NCCL|CUDA error|ECC|Xid|uncorrectable|illegal memory access|bus error|"
    r"segmentation fault|hardware|device-side assert|connection reset",
    re.IGNORECASE,
)
_CODE_PATTERNS = re.compile(
    r"SyntaxError|ImportError|ModuleNotFoundError|NameError|AttributeError|TypeError|"
    r"KeyError|ValidationError|FileNotFoundError|AssertionError",
)


def classify_failure(exit_code: int | None, reason: str | None) -> Cause:
    """Blame a FAILED job from its exit code and log excerpt; unknown stays unknown."""
    if exit_code == exitcodes.REQUEUE:
        return Cause.INFRA
    text = reason or ""
    if _NODE_PATTERNS.search(text):
        return Cause.NODE
    if _CODE_PATTERNS.search(text):
        return Cause.CODE
    return Cause.UNKNOWN
