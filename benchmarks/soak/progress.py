"""Ground truth from the training program's own log: which step ran when, with what loss.

Both systems run the same program, and its rank-0 JSON-lines log (`{"ts", "event", "attempt",
"job_id", "step", "loss", ...}` on stderr) says exactly what was trained. Scoring from it, not
from either system's account of itself, keeps the comparison honest. Parsing and trajectory
arithmetic are pure; `LogFollower` is the only part that reads files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from contracts.logs import json_records


@dataclass(frozen=True)
class StepEvent:
    t: float
    step: int
    loss: float
    incarnation: str
    skipped_update: bool = False
    step_time: float | None = None
    consumed: int | None = None  # the data cursor after the step (global sample index)

    @property
    def bad(self) -> bool:
        """A step whose update was thrown away (NaN/Inf grads) or whose loss is not finite."""
        return self.skipped_update or not math.isfinite(self.loss)


@dataclass(frozen=True)
class StartEvent:
    """One process group starting to train: from `step` (0 = scratch, else the resumed step)."""

    t: float
    step: int
    incarnation: str
    nodes: tuple[str, ...] = ()  # every node of the group, rank 0's first (empty: an older log)
    cursor: int | None = None  # the data cursor it resumed at
    #: The skip ranges the group trained with (the trainer's log does not say: the system that
    #: started it does, `with_skips`).
    skips: tuple[tuple[int, int], ...] = ()


@dataclass
class Progress:
    """Everything parsed so far, in time order."""

    starts: list[StartEvent] = field(default_factory=list)
    steps: list[StepEvent] = field(default_factory=list)

    def extend(self, other: Progress) -> None:
        self.starts.extend(other.starts)
        self.steps.extend(other.steps)
        self.starts.sort(key=lambda e: e.t)
        self.steps.sort(key=lambda e: e.t)

    @property
    def max_step(self) -> int:
        return max((e.step for e in self.steps), default=0)

    def first_reaching(self, step: int) -> StepEvent | None:
        """The first event (in time) at or past `step`."""
        return next((e for e in self.steps if e.step >= step), None)


def incarnation(record: dict) -> str:
    """A job run: the same SLURM job id runs again after a requeue, with a new attempt."""
    return f"{record.get('job_id')}/{record.get('attempt')}"


def _float(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def _int(value: object) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def parse_lines(lines: Iterable[str]) -> Progress:
    """Keep the trainer's `train_start` and `step` records; ignore everything else."""
    out = Progress()
    for rec in json_records(lines):
        event = rec.get("event")
        if event == "train_start":
            out.starts.append(
                StartEvent(
                    float(rec["ts"]),
                    int(rec["step"]),
                    incarnation(rec),
                    tuple(rec.get("nodes") or ()),
                    _int(rec.get("cursor")),
                )
            )
        elif event == "step":
            out.steps.append(
                StepEvent(
                    float(rec["ts"]),
                    int(rec["step"]),
                    _float(rec.get("loss")),
                    incarnation(rec),
                    bool(rec.get("skipped_update")),
                    rec.get("step_time"),
                    _int(rec.get("consumed")),
                )
            )
    out.starts.sort(key=lambda e: e.t)
    out.steps.sort(key=lambda e: e.t)
    return out


def final_trajectory(progress: Progress) -> dict[int, StepEvent]:
    """The steps that the model finally carries: each resume cuts the history back to its
    starting step, then its own steps follow (a step recomputed later replaces the earlier)."""
    traj: dict[int, StepEvent] = {}
    events: list[tuple[float, int, StartEvent | StepEvent]] = [
        *((s.t, 0, s) for s in progress.starts),
        *((e.t, 1, e) for e in progress.steps),
    ]
    for _, _, ev in sorted(events, key=lambda x: (x[0], x[1])):
        if isinstance(ev, StartEvent):
            for step in [s for s in traj if s > ev.step]:
                del traj[step]
        else:
            traj[ev.step] = ev
    return traj


def with_skips(progress: Progress, by_attempt: Mapping[int, Sequence[tuple[int, int]]]) -> Progress:
    """`progress` with each start's skip ranges, by the attempt number its log records."""
    starts = []
    for s in progress.starts:
        attempt = s.incarnation.rsplit("/", 1)[-1]
        skips = by_attempt.get(int(attempt), ()) if attempt.isdigit() else ()
        starts.append(replace(s, skips=tuple(tuple(r) for r in skips)))
    return Progress(starts, list(progress.steps))


def time_to_step(progress: Progress, step: int, t0: float) -> float | None:
    """Seconds from `t0` until `step` was first completed."""
    ev = progress.first_reaching(step)
    return None if ev is None else ev.t - t0


class LogFollower:
    """Reads new lines of every log file matching `pattern` under `root` (files may appear
    and grow while the soak runs; a partial last line waits for the next read)."""

    def __init__(self, root: Path, pattern: str) -> None:
        self.root = root
        self.pattern = pattern
        self._offsets: dict[Path, int] = {}
        self.progress = Progress()

    def poll(self) -> Progress:
        new: list[str] = []
        for path in sorted(self.root.glob(self.pattern)):
            start = self._offsets.get(path, 0)
            try:
                with path.open("rb") as fh:
                    fh.seek(start)
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self._offsets[path] = start + end
            new.extend(data[:end].decode("utf-8", errors="replace").splitlines())
        self.progress.extend(parse_lines(new))
        return self.progress
