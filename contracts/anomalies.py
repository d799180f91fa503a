"""The trainer's record of its bad steps, exact to the step and sample (docs/contracts.md).

Every rank knows, after the step's one all-reduce, each sample's loss and which nodes made
non-finite gradients, so the trainer dates a fault exactly, whatever the scrape interval. Global
rank 0 appends one JSON line per bad step to `<checkpoint dir>/.health/anomalies.jsonl` (one
`write` each, before the step's metrics move, so a scrape that counts a bad step finds its line
here), one `clean` line at the first good step after bad ones (the episode is over, known before
a scrape shows a later step), one `stop` line when it stops on its skipped-update budget, and
one `straggler` line when a node's own step time stays above the others' (the step's
all-reduce carries every rank's busy time, so the verdict needs no scrape either), and one
`stop_signal` line at the step whose all-reduce first carries a walltime or preemption
warning, before the save it leaves on (the supervisor prepares the next job meanwhile).
The supervisor reads the file (torch-free) to judge onsets, skip exactly the bad samples,
record contained faults and learn why a job ended even if no scrape saw the step.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

HEALTH_DIR = ".health"
LEDGER_NAME = "anomalies.jsonl"

#: Kinds of a bad step.
NONFINITE = "nonfinite"  # NaN/Inf loss or gradients: the optimizer skipped the update
SPIKE = "spike"  # the step's loss far above its recent trend: the update was applied
#: The line written at the first good step after bad ones (its step): the bad steps before it
#: are over, so the watchdog judges their episode without waiting for a scrape of a later step.
CLEAN = "clean"
#: The line written when the trainer stops on its budget of skipped updates.
STOP = "skip_budget"
#: A node whose busy time per step was above `straggler_ratio` × the other nodes' in more than
#: half of the last `straggler_steps` steps, or above twice the others' in each of the last
#: third of them (`nodes` names it, `ratio` says by how much, `window_steps` over how many steps).
STRAGGLER = "straggler"
#: The step at which the ranks learned of a stop signal (walltime or preemption warning):
#: they save there and leave with exit 75, and the run is requeued.
STOP_SIGNAL = "stop_signal"

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Anomaly:
    """One bad step (or, kind STOP, the trainer's stop on its budget)."""

    attempt: int
    step: int
    kind: str
    #: Global sample indices whose own loss was bad, as merged half-open ranges (empty when
    #: no sample stands out: non-finite gradients with finite losses are a node's doing).
    samples: Ranges = ()
    #: Nodes whose own gradients were non-finite before the reduction.
    nodes: tuple[str, ...] = ()
    #: The half-open range of global sample indices the step consumed (its first to its last).
    consumed: tuple[int, int] = (0, 0)
    update_skipped: bool = False
    loss: float | None = None
    #: The loss above which a step (and a sample) counted as a spike at this step.
    threshold: float | None = None
    t: float = 0.0
    #: For STOP: the skipped updates counted in the budget window, and the window's steps
    #: (for STRAGGLER: the steps judged, ending at `step`).
    skipped_updates: int = 0
    window_steps: int = 0
    #: For STRAGGLER: the median of the node's step time / the other nodes' over its slow steps.
    ratio: float | None = None

    @property
    def key(self) -> str:
        """Names the record among a run's: one line per (attempt, step, kind)."""
        return f"a{self.attempt}-s{self.step}-{self.kind}"

    def to_json(self) -> str:
        return json.dumps(
            {
                "attempt": self.attempt,
                "step": self.step,
                "kind": self.kind,
                "samples": [list(r) for r in self.samples],
                "nodes": list(self.nodes),
                "consumed": list(self.consumed),
                "update_skipped": self.update_skipped,
                "loss": _finite_or_none(self.loss),
                "threshold": _finite_or_none(self.threshold),
                "t": round(self.t, 3),
                "skipped_updates": self.skipped_updates,
                "window_steps": self.window_steps,
                "ratio": _finite_or_none(self.ratio),
            }
        )

    @classmethod
    def from_json(cls, line: str) -> Anomaly:
        d = json.loads(line)
        return cls(
            attempt=int(d["attempt"]),
            step=int(d["step"]),
            kind=str(d["kind"]),
            samples=tuple((int(a), int(b)) for a, b in d.get("samples", ())),
            nodes=tuple(str(n) for n in d.get("nodes", ())),
            consumed=tuple(int(x) for x in d.get("consumed", (0, 0))),  # type: ignore[arg-type]
            update_skipped=bool(d.get("update_skipped", False)),
            loss=d.get("loss"),
            threshold=d.get("threshold"),
            t=float(d.get("t", 0.0)),
            skipped_updates=int(d.get("skipped_updates", 0)),
            window_steps=int(d.get("window_steps", 0)),
            ratio=d.get("ratio"),
        )


def ledger_path(checkpoint_dir: Path) -> Path:
    return Path(checkpoint_dir) / HEALTH_DIR / LEDGER_NAME


def append(checkpoint_dir: Path, record: Anomaly) -> None:
    """Add one line in one `write` (O_APPEND), synced: the evidence outlives the job."""
    path = ledger_path(checkpoint_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (record.to_json() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def parse(text: str) -> list[Anomaly]:
    """Every complete line; a torn last line (a crash mid-write) is left for the next read."""
    out = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            out.append(Anomaly.from_json(line))
        except (ValueError, KeyError, TypeError):
            continue  # a line of another version or a torn one: not evidence
    return out


def read(checkpoint_dir: Path) -> list[Anomaly]:
    """The run's records, oldest first ([] when the trainer wrote none)."""
    try:
        return parse(ledger_path(checkpoint_dir).read_text())
    except OSError:
        return []


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sorted, merged half-open ranges (adjacent ones join), empty ones dropped."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return tuple(merged)


def ranges_of(indices: Sequence[int]) -> Ranges:
    """Global sample indices as merged half-open ranges."""
    return merge_ranges((i, i + 1) for i in indices)


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
