"""Pure parsers of squeue, sacct and sinfo text, tested on captured output without SLURM.

Reading is `cli.SlurmCluster`'s; turning the text into states is here, so every format
quirk is pinned by a test. Output that does not parse raises `SourceUnavailable`: a source
that answered nonsense is a source that could not be asked, never "no jobs".
"""

from __future__ import annotations

import re

import hostlist

from supervisor.slurm.types import (
    JobState,
    JobStatus,
    LiveJob,
    NodeInfo,
    NodeState,
    SourceUnavailable,
)

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

_JOB_ID = re.compile(r"\d+(_\d+)?")


def expand_hostlist(text: str) -> list[str]:
    """`n[1-3,5],rack[1-2]-n[01-02]` → host names, in order (python-hostlist parses SLURM's
    compressed host lists, several bracket groups in one name included)."""
    text = text.strip()
    if not text or text.startswith("None"):
        return []
    return hostlist.expand_hostlist(text)


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
        out[job_id] = _status(job_id, raw_state, nodelist, reason, code, sig)
    return out


def _status(
    job_id: str,
    raw_state: str,
    nodelist: str,
    reason: str,
    code: int | None,
    sig: int | None,
    time_left_s: float | None = None,
) -> JobStatus:
    return JobStatus(
        job_id=job_id,
        state=parse_state(raw_state),
        nodes=tuple(expand_hostlist(nodelist)),
        exit_code=code,
        exit_signal=sig,
        reason="" if reason == "None" else reason,
        raw_state=raw_state,
        time_left_s=time_left_s,
    )


def parse_time_left(text: str) -> float | None:
    """SLURM's `[days-][hours:]minutes:seconds` in seconds; None for anything else
    (UNLIMITED, NOT_SET, INVALID: no limit to plan for)."""
    days, _, clock = text.strip().rpartition("-")
    parts = clock.split(":")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    if days and not days.isdigit():
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return float(seconds + 86400 * int(days or 0))


SQUEUE_FORMAT = "JobID:|,State:|,NodeList:|,Reason:|,exit_code:|,TimeLeft:|"


def parse_squeue(text: str) -> dict[str, JobStatus]:
    """Parse `squeue -h -t all -O JobID:|,State:|,NodeList:|,Reason:|,exit_code:|,TimeLeft:|`.

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
        left = parse_time_left(cols[5]) if len(cols) > 5 else None
        out[job_id] = _status(job_id, raw_state, nodelist, reason, code, sig, left)
    return out


def parse_job_ids(text: str) -> list[str]:
    """One job id per line (`squeue -o %i`, `sacct -o JobIDRaw`); anything else is an error."""
    ids = [line.strip() for line in text.splitlines() if line.strip()]
    bad = [i for i in ids if not _JOB_ID.fullmatch(i)]
    if bad:
        raise SourceUnavailable(f"unexpected job id(s): {bad[:3]!r}")
    return ids


def parse_live_jobs(text: str, prefix: str) -> dict[str, LiveJob]:
    """`squeue -o %i|%j|%T|%N` → {job id: name and nodes} of the queued or running jobs named
    `prefix…` (a COMPLETING job is already on its way out)."""
    out: dict[str, LiveJob] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        job_id, sep, rest = line.strip().partition("|")
        cols = rest.rsplit("|", 2)
        if not sep or len(cols) != 3 or not _JOB_ID.fullmatch(job_id):
            raise SourceUnavailable(f"unexpected squeue line: {line!r}")
        name, raw_state, nodelist = cols
        if name.startswith(prefix) and raw_state != "COMPLETING" and parse_state(raw_state).active:
            out[job_id] = LiveJob(name, tuple(expand_hostlist(nodelist)))
    return out


def job_sort_key(job_id: str) -> tuple[int, ...]:
    """Job ids in submission order (`100` after `99`, an array's `7_2` after `7_1`)."""
    return tuple(int(p) for p in job_id.split("_"))


def parse_node_state(text: str) -> tuple[NodeState, str]:
    """sinfo's compact state → (base state, flag suffixes): `down*` → (DOWN, "*")."""
    match = re.fullmatch(r"([a-z_]*)(.*)", text.strip())
    word, flags = (match[1], match[2]) if match else ("", text.strip())
    try:
        return NodeState(word), flags
    except ValueError:
        return NodeState.UNKNOWN, flags


def parse_sinfo(text: str) -> dict[str, NodeInfo]:
    """Parse `sinfo -h -N -o %N|%t|%E`; a node listed in several partitions appears once."""
    out: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, state, reason = ([*line.split("|", 2), "", ""])[:3]
        base, flags = parse_node_state(state)
        out[name] = NodeInfo(name=name, state=base, reason=reason.strip(), flags=flags)
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
