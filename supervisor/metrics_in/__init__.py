"""Metrics in: the only package that speaks PromQL or scrapes workers' /metrics.

Two sources give the watchdog the same thing, a `MetricsView` per (run, attempt):
`PrometheusSource` (`promql`) asks a Prometheus server, `ScrapeSource` (`scrape`) scrapes the
workers' registered endpoints. `types` holds what both return, `samples` the exposed names →
sample fields and the trailing windows. The names below are the package's API.
"""

from supervisor.metrics_in.promql import PrometheusSource, PrometheusUnavailable, loss_history
from supervisor.metrics_in.scrape import ScrapeSource, Target
from supervisor.metrics_in.types import (
    DARK_AFTER_S,
    DARK_AFTER_SCRAPES,
    LossPoint,
    MetricSample,
    MetricSource,
    MetricsView,
    RunKey,
    SourceHealth,
)

__all__ = [
    "DARK_AFTER_S",
    "DARK_AFTER_SCRAPES",
    "LossPoint",
    "MetricSample",
    "MetricSource",
    "MetricsView",
    "PrometheusSource",
    "PrometheusUnavailable",
    "RunKey",
    "ScrapeSource",
    "SourceHealth",
    "Target",
    "loss_history",
]
