"""Restart inside the allocation: the supervisor's order to a job's node tasks, and the rank
exit records it reads back (docs/contracts.md, "Restart inside the allocation").

Torch-free and pure but for the two small file operations: the supervisor writes an order, the
node tasks of the job read it. Why files: they already share the run's directory (the trainer's
checkpoints and records live there too), an order must survive a supervisor crash, and a node
task must find the newest order without a server to ask.

- `<run dir>/jobs/<job id>/order.json` holds the newest `RestartOrder` (atomically replaced).
  A node task runs the attempt it was started with; an order with a higher attempt number makes
  it kill its ranks (if any still run) and fork the order's attempt, with the order's resume
  point and skips, its logs and exit codes in the order's folder.
- `<attempt folder>/<job id>_<rank>_exit_code` holds a rank's exit code, one per rank of that
  attempt: in a job that outlives its ranks, these (not SLURM) say that the attempt ended.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from contracts import exitcodes

ORDER_NAME = "order.json"


@dataclass(frozen=True)
class RestartOrder:
    """Attempt `attempt` of the run, started by the job's node tasks without a new sbatch."""

    attempt: int
    #: The attempt's folder (`contracts.paths.attempt_log_dir`); the ranks' logs and exit
    #: codes go to `<log_dir>/<job id>/`, laid out as submitit lays out a submitted job's.
    log_dir: str
    resume_step: int | None = None
    skip_ranges: tuple[tuple[int, int], ...] = ()
    stop_at_step: int | None = None
    mtbf_seconds: float | None = None
    #: The nodes that run the attempt's ranks, in rank order (a spare replacing a bad node);
    #: empty: the same nodes as before.
    nodes: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RestartOrder:
        raw = json.loads(text)
        return cls(
            attempt=int(raw["attempt"]),
            log_dir=str(raw["log_dir"]),
            resume_step=raw.get("resume_step"),
            skip_ranges=tuple((int(a), int(b)) for a, b in raw.get("skip_ranges", ())),
            stop_at_step=raw.get("stop_at_step"),
            mtbf_seconds=raw.get("mtbf_seconds"),
            nodes=tuple(str(n) for n in raw.get("nodes", ())),
        )


def job_control_dir(run_dir: Path, job_id: str) -> Path:
    return Path(run_dir) / "jobs" / job_id


LEAVE_NAME = "leave"


def request_leave(control_dir: Path) -> None:
    """Ask the job's ranks, should they be training on through a stop signal, to leave at
    their next step: the supervisor stops the job itself, and its TERM is no preemption whose
    grace is worth training through (`megatron_runs.handover`)."""
    control_dir.mkdir(parents=True, exist_ok=True)
    (control_dir / LEAVE_NAME).touch()


def leave_requested(control_dir: Path) -> bool:
    return (control_dir / LEAVE_NAME).exists()


def standby_ready_dir(run_dir: Path, attempt: int) -> Path:
    """Where the node tasks of attempt `attempt`'s standby job that will run its ranks each
    leave an empty file named after their node once they imported the training program: the
    ranks of the attempt before it, training through a stop signal, leave once all are there
    (`megatron_runs.handover`)."""
    return Path(run_dir) / "standby" / f"a{attempt}"


def mark_standby_ready(run_dir: Path, attempt: int, node: str) -> None:
    folder = standby_ready_dir(run_dir, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / node).touch()


def standby_ready(run_dir: Path, attempt: int, nodes: int) -> bool:
    """Whether `nodes` of attempt `attempt`'s standby nodes are ready (`standby_ready_dir`)."""
    try:
        return sum(1 for _ in standby_ready_dir(run_dir, attempt).iterdir()) >= nodes
    except OSError:
        return False


def write_order(control_dir: Path, order: RestartOrder) -> Path:
    """Publish `order` (write, fsync, rename): a reader sees the old order or the new one,
    never half of one, and the order survives a crash of the writer's host."""
    control_dir.mkdir(parents=True, exist_ok=True)
    path = control_dir / ORDER_NAME
    tmp = control_dir / f".{ORDER_NAME}.{os.getpid()}"
    with tmp.open("w") as fh:
        fh.write(order.to_json())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def read_order(control_dir: Path) -> RestartOrder | None:
    """The newest order, or None (no order yet, or one that cannot be read: not acted on)."""
    try:
        return RestartOrder.from_json((control_dir / ORDER_NAME).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def exit_code_path(job_folder: Path, job_id: str, rank: int) -> Path:
    return Path(job_folder) / f"{job_id}_{rank}_exit_code"


def exit_records(job_folder: Path, job_id: str) -> list[tuple[int, int, int]]:
    """(modification time in ns, rank, exit code) of the ranks of this folder's attempt that
    have ended, in the order they ended (ties by rank)."""
    found: list[tuple[int, int, int]] = []
    try:
        paths = list(Path(job_folder).glob(f"{job_id}_*_exit_code"))
    except OSError:
        return []
    for path in paths:
        rank = path.name[len(job_id) + 1 : -len("_exit_code")]
        try:
            found.append((path.stat().st_mtime_ns, int(rank), int(path.read_text())))
        except (OSError, ValueError):
            continue
    return sorted(found)


def read_exit_codes(job_folder: Path, job_id: str) -> list[tuple[int, int]]:
    """(rank, exit code) of the ranks of this folder's attempt that have ended, in the order
    they ended (`exit_records`)."""
    return [(rank, code) for _, rank, code in exit_records(job_folder, job_id)]


def all_finished_at(records: Sequence[tuple[int, int, int]], world_size: int) -> float | None:
    """When (unix s) the last of an attempt's `world_size` ranks exited, if every one of them
    exited 0 (finished training); None otherwise. `records` as `exit_records` gives them."""
    if len(records) != world_size or any(code != exitcodes.OK for _, _, code in records):
        return None
    return records[-1][0] / 1e9


def all_checkpointed(records: Sequence[tuple[int, int, int]], world_size: int) -> bool:
    """Every one of an attempt's `world_size` ranks exited, none failed, and one at least
    checkpointed on a stop signal (75): the attempt ended to be requeued, though SLURM may
    still list its job for the moments its node tasks take to leave."""
    codes = {code for _, _, code in records}
    return (
        len(records) == world_size and codes <= exitcodes.CLEAN_EXITS and exitcodes.REQUEUE in codes
    )


def failed_exit(codes: Sequence[tuple[int, int]]) -> int | None:
    """The code of the first rank that failed, None if none did. The first failure is the
    cause, later ones its consequences (as the node task judges, `worker.ranks.node_outcome`).

    A rank that finished (0) or checkpointed on a stop signal (75) is no failure: its node task
    ends, and SLURM reports the job."""
    failed = [code for _, code in codes if code not in exitcodes.CLEAN_EXITS]
    return failed[0] if failed else None


#: The environment variable that hands a rank the in-memory checkpoint tier its node task
#: keeps for it: the descriptors of its slots, comma-separated (`megatron_runs.memory_tier`).
MEMORY_TIER_ENV = "NIGHTWATCH_MEMORY_TIER_FDS"
#: Slots per rank: the newest capture, and the one before it while the next is written.
MEMORY_TIER_SLOTS = 2


def memory_tier_env(fds: Sequence[int]) -> dict[str, str]:
    return {MEMORY_TIER_ENV: ",".join(str(fd) for fd in fds)}


def memory_tier_fds(environ: Mapping[str, str]) -> tuple[int, ...]:
    """The slot descriptors handed to this rank; empty when it has no memory tier."""
    raw = environ.get(MEMORY_TIER_ENV, "")
    return tuple(int(fd) for fd in raw.split(",") if fd)
