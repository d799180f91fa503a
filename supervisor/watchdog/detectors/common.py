"""What every detector shares: thresholds, step order, health gates, onset evidence."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from contracts.spec import RecoverySpec
from supervisor.metrics_in import MetricSample, SourceHealth
from supervisor.models import AttemptState
from supervisor.watchdog.snapshot import Finding, Snapshot

#: Fewest baseline samples before a throughput drop can be judged at all.
MIN_BASELINE_SAMPLES = 5


#: Fewest training steps a loss baseline must have watched before a spike can be judged.
MIN_BASELINE_STEPS = 5


#: Fewest samples a loss baseline is made of when the step window holds fewer.
BASELINE_MIN_POINTS = 12


#: 1.4826 × MAD estimates the standard deviation of normal noise.
MAD_TO_SIGMA = 1.4826


Detector = Callable[[Snapshot, RecoverySpec], list[Finding]]


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def by_step(samples: Sequence[MetricSample]) -> list[MetricSample]:
    """One sample per training step (the latest observation of it), oldest first.

    Samples from before the process finished its first step (last-step time still 0) carry
    placeholder zeros, not measurements, and are left out."""
    out: list[MetricSample] = []
    for s in samples:
        if s.step is None or s.last_step_ts == 0:
            continue
        if out and out[-1].step == s.step:
            out[-1] = s
        elif not out or s.step > (out[-1].step or 0):
            out.append(s)
        else:  # the step went backwards: a restart inside the window; keep the newer history
            out = [s]
    return out


def job_running(snap: Snapshot) -> bool:
    """SLURM says the job runs and is not being torn down: a hang in a COMPLETING job is
    the teardown's, and its final state (NODE_FAIL, CANCELLED, ...) is the finding."""
    job = snap.job
    running = job.state is AttemptState.RUNNING
    return job.health is SourceHealth.UP and running and not job.completing


def metrics_ok(snap: Snapshot) -> bool:
    return snap.metrics.health is SourceHealth.UP and bool(snap.metrics.samples)


def step_window(a: MetricSample | None, b: MetricSample) -> tuple[int, int] | None:
    """Global samples consumed after observation `a` up to observation `b` (half-open)."""
    if a is None or a.samples_consumed is None or b.samples_consumed is None:
        return None
    lo, hi = a.samples_consumed, b.samples_consumed
    return (lo, hi) if hi > lo else None


def onset_fields(healthy: MetricSample | None, first_bad: MetricSample) -> dict[str, object]:
    """Onset bounds. The fault time is the earliest the fault can have happened (the end of
    the last step seen healthy), so measured detection latency and MTTR never flatter us."""
    if healthy is None:
        fault_time = first_bad.t
    else:
        fault_time = healthy.last_step_ts if healthy.last_step_ts else healthy.t
    return {
        "fault_time": fault_time,
        "last_healthy_step": healthy.step if healthy is not None else None,
        "first_bad_step": first_bad.step,
        "sample_window": step_window(healthy, first_bad),
    }


def json_float(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return str(x)
