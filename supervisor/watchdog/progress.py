"""A run's progress as the watchdog last observed it: what `nightwatch runs` / `status` and
`GET /v1/runs/{id}` show while the run trains (pure; stored by the reconciler once a tick)."""

from __future__ import annotations

import math
from typing import Any

from supervisor.metrics_in import MetricsView, SourceHealth
from supervisor.watchdog.detectors import median_step_time


def _finite(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None and math.isfinite(value) else None


def observed_progress(
    view: MetricsView,
    target_steps: int,
    checkpoint_step: int | None,
    ettr: float | None,
    now: float,
) -> dict[str, Any] | None:
    """Step, loss, grad norm, tokens/s, ETA, newest checkpoint and ETTR from fresh metrics;
    None without them (a run's last known progress then stays as it was). `observed_at` is
    unix seconds; non-finite values are null (JSON has no NaN)."""
    latest = view.latest
    if view.health is not SourceHealth.UP or latest is None or latest.step is None:
        return None
    step_s = median_step_time(view.samples)
    left = max(0, target_steps - latest.step)
    return {
        "step": latest.step,
        "target_steps": target_steps,
        "loss": _finite(latest.loss, 4),
        "grad_norm": _finite(latest.grad_norm, 4),
        "tokens_per_second": _finite(latest.tokens_per_second, 1),
        "step_seconds": _finite(step_s, 4),
        "eta_seconds": _finite(left * step_s, 0) if step_s is not None else None,
        "checkpoint_step": checkpoint_step,
        "ettr": _finite(ettr, 4),
        "observed_at": round(now, 3),
    }


def changed(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Worth a write: anything but the time of the observation differs."""
    if old is None:
        return True
    return {k: v for k, v in old.items() if k != "observed_at"} != {
        k: v for k, v in new.items() if k != "observed_at"
    }
