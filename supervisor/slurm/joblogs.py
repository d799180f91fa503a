"""Pure classification of a job's log text: what ended it, and which host it names.

Why separate from reading: the supervisor tails logs at the edge (`supervisor.slurm.files`),
and this module turns captured text into findings, so every pattern is tested on recorded logs
without SLURM. The classes are evidence for the policy (a gloo/NCCL error naming a peer
suggests that node; an OOM suggests a smaller micro-batch, not a node swap).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


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
    r"(?:Exited with exit code (?P<code>\d+)|Killed|Terminated|Aborted|Segmentation fault)"
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
