"""A run's task logs: which file holds node N's output of attempt A, read in chunks.

submitit writes one file per task of the job (`<attempt log dir>/<job id>/<job id>_<task>_log.out`,
stderr merged into it), and a job runs one task per node in SLURM's node-list order, so task K
is the attempt's K-th node. Reading is by byte offset: a follower asks again from the offset it
was given and gets only what was written since, whole lines only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.logs import log_events
from contracts.paths import attempt_log_dir
from supervisor.metrics_in import LossPoint
from supervisor.slurm import last_lines, read_from

#: The most one read returns, so a follower of a chatty job gets it in pieces.
MAX_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class LogChunk:
    node: str
    nodes: tuple[str, ...]
    text: str
    offset: int


class UnknownNode(LookupError):
    """The attempt ran on other nodes."""


def task_files(
    home: Path, run_id: str, attempt: int, job_id: str, nodes: list[str]
) -> dict[str, Path]:
    """node → its task's log file, in the job's node order. Before SLURM has named the nodes,
    the tasks found on disk stand for them as `task0`, `task1`, …"""
    folder = attempt_log_dir(home, run_id, attempt) / job_id
    if nodes:
        return {node: folder / f"{job_id}_{k}_log.out" for k, node in enumerate(nodes)}
    found = sorted(folder.glob(f"{job_id}_*_log.out"), key=lambda p: int(p.name.split("_")[1]))
    return {f"task{p.name.split('_')[1]}": p for p in found} or {
        "task0": folder / f"{job_id}_0_log.out"
    }


def read_log(files: dict[str, Path], node: str | None, tail: int, offset: int | None) -> LogChunk:
    """`node`'s log (default: the first node's, where rank 0 logs): its last `tail` lines, or
    what follows `offset`."""
    nodes = tuple(files)
    chosen = node or nodes[0]
    placeholder = re.fullmatch(r"task(\d+)", chosen)
    if chosen not in files and placeholder and int(placeholder[1]) < len(nodes):
        chosen = nodes[int(placeholder[1])]  # named before SLURM reported the job's nodes
    if chosen not in files:
        raise UnknownNode(f"node {chosen!r} is not one of this attempt's: {', '.join(nodes)}")
    path = files[chosen]
    if offset is None:
        text, end = last_lines(path, tail, MAX_CHUNK_BYTES)
    else:
        text, end = read_from(path, offset, MAX_CHUNK_BYTES)
    return LogChunk(node=chosen, nodes=nodes, text=text, offset=end)


def loss_points(
    home: Path, run_id: str, attempts: Sequence[Mapping[str, Any]], event: str = "step"
) -> list[LossPoint]:
    """The loss curve from the trainer's own `step` lines (every `log_interval` steps and every
    skipped update), each with the time it was logged: the report's curve when no Prometheus
    server keeps the samples. Rank 0 logs on the attempt's first node. `event="eval"`: the
    validation loss from its `eval` lines (`training.eval_interval`)."""
    out: list[LossPoint] = []
    for a in attempts:
        if not a.get("job_id"):
            continue
        number = int(a["number"])
        files = task_files(home, run_id, number, str(a["job_id"]), list(a.get("nodes") or []))
        path = next(iter(files.values()))
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        out.extend(_step_points(text, number, event))
    return out


def _step_points(text: str, attempt: int, event: str = "step") -> list[LossPoint]:
    """The finite losses of global rank 0's `event` lines (`contracts.logs.log_events` parses
    them; every rank logs its `eval` lines, the same value)."""
    points = []
    for row in log_events(text):
        if row.get("event") != event or row.get("rank", 0) != 0:
            continue
        try:
            point = LossPoint(
                step=int(row["step"]), loss=float(row["loss"]), attempt=attempt,
                t=float(row["ts"]), source="log" if event == "step" else event,
            )  # fmt: skip
        except (ValueError, KeyError, TypeError):
            continue  # a line of another shape
        if math.isfinite(point.loss):
            points.append(point)
    return points
