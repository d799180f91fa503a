"""The progress a run shows while it trains (pure)."""

from __future__ import annotations

import math

from supervisor.metrics_in import MetricSample, MetricsView, SourceHealth
from supervisor.watchdog.progress import changed, observed_progress


def _view(health: SourceHealth = SourceHealth.UP, loss: float = 2.0) -> MetricsView:
    samples = tuple(
        MetricSample(t=100.0 + i, step=40 + 2 * i, loss=loss, last_step_ts=100.0 + i,
                     tokens_per_second=1234.5, grad_norm=1.25)
        for i in range(3)
    )  # fmt: skip
    return MetricsView(health, samples)


def test_eta_is_steps_left_times_the_step_time_seen() -> None:
    p = observed_progress(_view(), 100, 40, 0.97, now=200.0)
    assert p == {
        "step": 44, "target_steps": 100, "loss": 2.0, "grad_norm": 1.25,
        "tokens_per_second": 1234.5, "step_seconds": 0.5, "eta_seconds": 28.0,
        "checkpoint_step": 40, "ettr": 0.97, "observed_at": 200.0,
    }  # fmt: skip


def test_no_fresh_metrics_no_progress_and_nan_is_null() -> None:
    assert observed_progress(_view(SourceHealth.STALE), 100, None, None, now=1.0) is None
    assert observed_progress(MetricsView(SourceHealth.UP), 100, None, None, now=1.0) is None
    nan = observed_progress(_view(loss=math.nan), 100, None, None, now=1.0)
    assert nan is not None and nan["loss"] is None


def test_only_a_change_beyond_the_time_of_observation_is_written() -> None:
    a = observed_progress(_view(), 100, 40, None, now=1.0)
    b = observed_progress(_view(), 100, 40, None, now=2.0)
    assert a is not None and b is not None
    assert changed(None, a) and not changed(a, b)
    assert changed(a, {**b, "checkpoint_step": 44})
