"""Pure accounting: per incident (detection latency, MTTR, steps lost) and per run (ETTR).

Definitions match `supervisor.report` (the overnight report): fault time is the first bad
observation (bounded by the last healthy one), recovery is the first sample of a later attempt
that shows a step beyond the step it resumed from, and ETTR is productive training time (only
steps that advanced beyond the previous maximum) over wall time since the first attempt started.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from supervisor.metrics_in import MetricSample


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


def productive_steps(start_step: int | None, reached: Iterable[int | None]) -> int:
    """Steps that moved training beyond its previous maximum: the highest step ever reached
    (`reached`: per attempt / incident / the live gauge) minus where the first attempt
    started. Steps replayed after a rollback never raise the maximum, and failed submissions
    or attempts stuck at one step add nothing, so none of them counts as productive."""
    top = max((r for r in reached if r is not None), default=None)
    if top is None:
        return 0
    return max(0, top - (start_step or 0))


def run_ettr(*, wall_s: float, productive_steps: int, mean_step_s: float | None) -> float | None:
    """Productive time / wall time, productive time = productive steps × mean step time.
    (Counting only the gaps between attempts as downtime reported 0.98 for a run stuck at
    one step for 200 s.) None while wall time or the step time is unknown."""
    if wall_s <= 0 or mean_step_s is None:
        return None
    return max(0.0, min(1.0, productive_steps * mean_step_s / wall_s))


def mtbf_estimate(training_seconds: float, faults: int, prior_seconds: float) -> float:
    """The run's mean time between failures: its training time over its faults, with the
    spec's prior counted as one fault-free stretch, so a run without faults yet keeps the prior
    and one with many converges to its own rate."""
    return (max(training_seconds, 0.0) + prior_seconds) / (max(faults, 0) + 1)
