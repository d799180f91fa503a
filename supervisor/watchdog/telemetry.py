"""The watchdog's `nightwatch_supervisor_*` metrics (docs/contracts.md), on an injected registry,
and the one place the tick exports them from (`Telemetry`).

`runs{state}` belongs to `supervisor.metrics.SupervisorMetrics` (the API's); the reconciler sets
it through that object when given one, so both share one registry without double registration.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy import func, select

from supervisor import accounting, store
from supervisor.db import Database
from supervisor.metrics import SupervisorMetrics
from supervisor.metrics_in import MetricsView
from supervisor.models import ACTIVE_RUN_STATES, Incident, Node, NodeHealth, Run, RunState
from supervisor.watchdog.detectors import median_step_time
from supervisor.watchdog.snapshot import CheckpointRef, Finding, FindingKind, Remedy, RemedyKind

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
        self._run_incidents: set[tuple[str, str]] = set()
        self.run_incidents = Gauge(
            f"{NS}_run_incidents",
            "Incidents of an active or escalated run so far, by kind (contained ones included): "
            "the dashboards' incidents filtered by run.",
            ["run_id", "kind"],
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

    def set_run_incidents(self, counts: dict[tuple[str, str], int]) -> None:
        """(run id, kind) → incidents so far, for the watched runs that had any; a run that
        ended loses its series."""
        for run_id, kind in self._run_incidents - set(counts):
            self.run_incidents.remove(run_id, kind)
        for (run_id, kind), n in counts.items():
            self.run_incidents.labels(run_id=run_id, kind=kind).set(n)
        self._run_incidents = set(counts)

    def forget_run(self, run_id: str) -> None:
        """Drop a finished run's per-run series so /metrics does not grow without bound."""
        for gauge in (self.run_ettr, self.run_budget_left, self.run_checkpoint_age):
            with contextlib.suppress(KeyError):
                gauge.remove(run_id)


#: Seconds between refreshes of a run's ETTR gauge, and how many runs one tick refreshes. Each
#: refresh is three DB reads (`benchmarks/reconcile_scale.py`, 1,000 runs: 50 a tick gave a
#: steady tick of 1.0-1.2 s against 0.84-0.95 s; 10 a tick, a runs phase of 0.13-0.15 s against
#: 0.13-0.20 s, within noise), so a large fleet's refreshes are spread thin: 1,000 runs take
#: 100 ticks to go round, a handful of runs refresh every 30 s.
ETTR_REFRESH_S = 30.0
ETTR_REFRESHES_PER_TICK = 10


class Telemetry:
    """Everything the tick exports, set from what the tick saw and did. Remembers only when
    each run's ETTR gauge was last set (to spread refreshes over ticks), forgotten with the
    run's series."""

    def __init__(
        self,
        db: Database,
        registry: CollectorRegistry,
        supervisor_metrics: SupervisorMetrics | None = None,
    ) -> None:
        self.db = db
        self.metrics = WatchdogMetrics(registry)
        self.supervisor_metrics = supervisor_metrics
        self._ettr_exported: dict[str, float] = {}  # run → when its ETTR gauge was last set
        self.last_ettr: dict[str, float] = {}  # run → the ETTR it was last set to
        self._refreshes = 0

    def tick_started(self) -> None:
        self._refreshes = 0

    def tick_ended(
        self, duration_s: float, now: float, slurm_up: bool, source: str, metrics_up: bool
    ) -> None:
        m = self.metrics
        m.tick_duration.observe(duration_s)
        m.last_tick.set(now)
        m.source_up.labels(source="slurm").set(1 if slurm_up else 0)
        m.source_up.labels(source=source).set(1 if metrics_up else 0)
        with self.db.session() as s:
            excluded = s.scalar(
                select(func.count()).select_from(Node).where(Node.health == NodeHealth.EXCLUDED)
            )
            m.excluded_nodes.set(excluded or 0)
            watched = store.run_states(s, [*ACTIVE_RUN_STATES, RunState.NEEDS_ATTENTION])
            m.set_needs_attention(
                {run_id: state is RunState.NEEDS_ATTENTION for run_id, state in watched.items()}
            )
            m.set_run_incidents(store.incident_counts(s, list(watched)))
            if self.supervisor_metrics is not None:
                self.supervisor_metrics.set_run_counts(store.count_runs_by_state(s))

    @property
    def ettr_refreshes(self) -> int:
        return self._refreshes

    def run_seen(
        self, run_id: str, checkpoints: Sequence[CheckpointRef], view: MetricsView, now: float
    ) -> None:
        """A run still training: its checkpoint age, and its ETTR when its turn has come (a
        healthy run's dashboard needs it too)."""
        if checkpoints:
            self.metrics.run_checkpoint_age.labels(run_id=run_id).set(
                max(0.0, now - checkpoints[-1].saved_at)
            )
        if (
            view.samples  # nothing to compute yet: no refresh slot taken
            and self._refreshes < ETTR_REFRESHES_PER_TICK
            and now - self._ettr_exported.get(run_id, -math.inf) >= ETTR_REFRESH_S
        ):
            self._refreshes += 1
            self.ettr(run_id, view, now)

    def incident_opened(self, finding: Finding, now: float) -> None:
        self.metrics.incidents.labels(kind=finding.kind.value).inc()
        fault_ts = finding.fault_time if finding.fault_time is not None else now
        latency = accounting.detection_latency(fault_ts, now)
        if latency is not None:
            self.metrics.detection_latency.observe(latency)

    def recovered(
        self, run_id: str, fault_ts: float | None, recovered_t: float, view: MetricsView, now: float
    ) -> None:
        if fault_ts is not None:
            self.metrics.mttr.observe(max(0.0, recovered_t - fault_ts))
        self.ettr(run_id, view, now)

    def remedied(
        self, run_id: str, remedy: Remedy, applied: bool, budget_left: int, view: MetricsView,
        now: float,
    ) -> None:  # fmt: skip
        if applied:
            self.metrics.remedies.labels(kind=remedy.kind.value).inc()
        self.metrics.run_budget_left.labels(run_id=run_id).set(budget_left)
        self.ettr(run_id, view, now)

    def keep_runs(self, run_ids: set[str]) -> None:
        """Forget the refresh times of runs no longer watched (ended or deleted)."""
        self._ettr_exported = {k: v for k, v in self._ettr_exported.items() if k in run_ids}
        self.last_ettr = {k: v for k, v in self.last_ettr.items() if k in run_ids}

    def run_finished(self, run_id: str) -> None:
        self.metrics.forget_run(run_id)
        self._ettr_exported.pop(run_id, None)
        self.last_ettr.pop(run_id, None)

    def ettr(self, run_id: str, view: MetricsView, now: float) -> None:
        """ETTR gauge: steps reached come from the incidents (step before each fault), the
        run's last step and the live gauge."""
        with self.db.session() as s:
            attempts = store.get_attempts(s, run_id)
            evidence = s.scalars(
                select(Incident.evidence_json).where(Incident.run_id == run_id)
            ).all()
            last_step = s.scalar(select(Run.last_step).where(Run.id == run_id))
        starts = [a.started_at.timestamp() for a in attempts if a.started_at is not None]
        first = min(attempts, key=lambda a: a.number, default=None)
        reached = [
            *((ev or {}).get("step") for ev in evidence),
            last_step,
            view.latest.step if view.latest is not None else None,
        ]
        ettr = accounting.run_ettr(
            wall_s=now - min(starts) if starts else 0.0,
            productive_steps=accounting.productive_steps(
                first.resume_step if first is not None else None, reached
            ),
            mean_step_s=median_step_time(view.samples) if view.samples else None,
        )
        self._ettr_exported[run_id] = now  # unknown (no step time yet) waits its turn too
        if ettr is not None:
            self.metrics.run_ettr.labels(run_id=run_id).set(ettr)
            self.last_ettr[run_id] = ettr
