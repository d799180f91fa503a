"""The watchdog's `nightwatch_supervisor_*` metrics (docs/contracts.md), on an injected registry.

`runs{state}` belongs to `supervisor.metrics.SupervisorMetrics` (the API's); the reconciler sets
it through that object when given one, so both share one registry without double registration.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from supervisor.watchdog.snapshot import FindingKind, RemedyKind

NS = "nightwatch_supervisor"
_LATENCY_BUCKETS = (0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800)


class WatchdogMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._needs_attention: set[tuple[str]] = set()
        self.incidents = Counter(
            f"{NS}_incidents", "Incidents opened, by finding kind.", ["kind"], registry=registry
        )
        self.remedies = Counter(
            f"{NS}_remedies", "Remedies applied, by kind.", ["kind"], registry=registry
        )
        self.detection_latency = Histogram(
            f"{NS}_detection_latency_seconds",
            "Fault (first bad sample) to finding.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.mttr = Histogram(
            f"{NS}_mttr_seconds",
            "Fault to training progressing again.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.tick_duration = Histogram(
            f"{NS}_tick_duration_seconds",
            "One reconcile tick over all active runs.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
            registry=registry,
        )
        self.last_tick = Gauge(
            f"{NS}_last_tick_timestamp_seconds", "When the last tick ended.", registry=registry
        )
        self.source_up = Gauge(
            f"{NS}_source_up",
            "1 when the source answered last tick.",
            ["source"],
            registry=registry,
        )
        self.excluded_nodes = Gauge(
            f"{NS}_excluded_nodes", "Nodes excluded from scheduling.", registry=registry
        )
        self.run_ettr = Gauge(
            f"{NS}_run_ettr_ratio", "Effective training time ratio.", ["run_id"], registry=registry
        )
        self.run_budget_left = Gauge(
            f"{NS}_run_recovery_budget_left",
            "Restarts left in the current window.",
            ["run_id"],
            registry=registry,
        )
        self.run_checkpoint_age = Gauge(
            f"{NS}_run_checkpoint_age_seconds",
            "Age of the newest complete checkpoint.",
            ["run_id"],
            registry=registry,
        )
        self.run_needs_attention = Gauge(
            f"{NS}_run_needs_attention",
            "1 while the run waits for a human (needs_attention), 0 while it is active.",
            ["run_id"],
            registry=registry,
        )
        # Every kind exported at 0 from the start: `increase()` needs a sample before the
        # first increment, so a series born at 1 hid the first incident of each kind since
        # the supervisor started from the dashboards' annotations and panels.
        for finding in FindingKind:
            self.incidents.labels(kind=finding.value)
        for remedy in RemedyKind:
            if remedy is not RemedyKind.NONE:
                self.remedies.labels(kind=remedy.value)

    def set_needs_attention(self, watched: dict[str, bool]) -> None:
        """run id → needs attention, for every active or escalated run: 1 names the run to page
        about, 0 says it is watched and fine; a run that ended loses its series."""
        for (run_id,) in self._needs_attention - {(r,) for r in watched}:
            self.run_needs_attention.remove(run_id)
        for run_id, escalated in watched.items():
            self.run_needs_attention.labels(run_id=run_id).set(1 if escalated else 0)
        self._needs_attention = {(r,) for r in watched}

    def forget_run(self, run_id: str) -> None:
        """Drop a finished run's per-run series so /metrics does not grow without bound."""
        for gauge in (self.run_ettr, self.run_budget_left, self.run_checkpoint_age):
            with contextlib.suppress(KeyError):
                gauge.remove(run_id)
