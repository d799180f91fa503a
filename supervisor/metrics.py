"""The supervisor's own Prometheus metrics (`nightwatch_supervisor_*`), on an injected registry.

The API creates one `SupervisorMetrics` per app and keeps it at `app.state.metrics`; the
watchdog adds its metrics to the same `registry`, so /metrics shows everything.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from supervisor.models import RunState

NAMESPACE = "nightwatch_supervisor"


class SupervisorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # set from the database per scrape; with several API processes the newest set wins
        self.runs = Gauge(
            f"{NAMESPACE}_runs",
            "Runs by state.",
            ["state"],
            registry=registry,
            multiprocess_mode="mostrecent",
        )
        self.http_requests = Counter(
            f"{NAMESPACE}_http_requests_total",
            "API requests by route template and status code.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.http_duration = Histogram(
            f"{NAMESPACE}_http_request_duration_seconds",
            "API request latency by route template.",
            ["method", "route"],
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )

    def set_run_counts(self, counts: Mapping[RunState, int]) -> None:
        for state in RunState:
            self.runs.labels(state=state.value).set(counts.get(state, 0))
