"""Pure accounting: per incident (detection latency, MTTR, steps lost) and per run (ETTR).

Definitions match `supervisor.report` (the overnight report): fault time is the first bad
observation (bounded by the last healthy one), recovery is the first sample of a later attempt
that shows a step beyond the step it resumed from, and ETTR is productive training time over
wall time since the first attempt started.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.watchdog.snapshot import MetricSample


def detection_latency(fault_ts: float | None, detected_ts: float) -> float | None:
    if fault_ts is None:
        return None
    return max(0.0, detected_ts - fault_ts)


def recovery_time(samples: Sequence[MetricSample], resumed_from: int | None) -> float | None:
    """When training progressed again: the first sample past the resume step (None: not yet)."""
    start = resumed_from or 0
    for s in samples:
        if s.step is not None and s.step > start:
            return s.t
    return None


def steps_lost(step_at_fault: int | None, resumed_from: int | None) -> int | None:
    """Steps that must be recomputed: reached before the fault minus where training resumed."""
    if step_at_fault is None:
        return None
    return max(0, step_at_fault - (resumed_from or 0))


@dataclass(frozen=True)
class Interval:
    start: float
    end: float | None  # None: still running


def run_ettr(
    running: Sequence[Interval],
    *,
    now: float,
    steps_lost_total: int,
    mean_step_s: float | None,
) -> float | None:
    """(time jobs ran − time spent recomputing lost steps) / wall time since the first start."""
    if not running:
        return None
    first = min(i.start for i in running)
    wall = now - first
    if wall <= 0:
        return None
    ran = sum(max(0.0, (i.end if i.end is not None else now) - i.start) for i in running)
    replay = steps_lost_total * (mean_step_s or 0.0)
    return max(0.0, min(1.0, (ran - replay) / wall))
