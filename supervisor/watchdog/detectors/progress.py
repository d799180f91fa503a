"""Progress faults: hangs (at start-up and in training), stragglers, throughput drops."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any

from contracts.spec import RecoverySpec
from supervisor.metrics_in import DARK_AFTER_S, MetricSample, SourceHealth
from supervisor.watchdog.detectors.common import (
    MIN_BASELINE_SAMPLES,
    by_step,
    finite,
    job_running,
    metrics_ok,
)
from supervisor.watchdog.snapshot import Cause, Finding, FindingKind, Snapshot


def detect_throughput_drop(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Tokens/s of the last k steps all below ratio × the attempt's own median."""
    if not metrics_ok(snap):
        return []
    k = rc.loss_spike_sustain_steps
    points = [p for p in by_step(snap.metrics.samples) if finite(p.tokens_per_second)]
    if len(points) < MIN_BASELINE_SAMPLES + k:
        return []
    baseline = statistics.median(p.tokens_per_second for p in points[:-k])  # type: ignore[misc]
    recent = [p.tokens_per_second for p in points[-k:]]
    if baseline <= 0 or any(v >= rc.throughput_drop_ratio * baseline for v in recent):  # type: ignore[operator]
        return []
    return [
        Finding(
            kind=FindingKind.THROUGHPUT_DROP,
            summary=f"tokens/s {recent[-1]:.4g} vs baseline {baseline:.4g}",
            cause=Cause.UNKNOWN,
            evidence={"tokens_per_second": recent, "baseline": baseline},
            fault_time=points[-k].t,
            first_bad_step=points[-k].step,
        )
    ]


def detect_straggler(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """A node whose step time exceeds ratio × the median of the other nodes, k samples running."""
    if not metrics_ok(snap):
        return []
    k = rc.loss_spike_sustain_steps
    points = [p for p in by_step(snap.metrics.samples) if len(p.step_time) >= 2]
    if len(points) < k:
        return []
    suspects: set[str] | None = None
    ratios: dict[str, float] = {}
    for p in points[-k:]:
        slow = set()
        for node, t in p.step_time.items():
            others = [v for n, v in p.step_time.items() if n != node]
            ref = statistics.median(others)
            if ref > 0 and t > rc.straggler_ratio * ref:
                slow.add(node)
                ratios[node] = t / ref
        suspects = slow if suspects is None else suspects & slow
    if not suspects:
        return []
    return [
        Finding(
            kind=FindingKind.STRAGGLER,
            summary=f"node {node} steps {ratios[node]:.2f}× slower than the others",
            cause=Cause.NODE,
            evidence={"ratio": ratios[node], "step_time": dict(points[-1].step_time)},
            fault_time=points[-k].t,
            first_bad_step=points[-k].step,
            nodes=(node,),
        )
        for node in sorted(suspects)
    ]


def median_step_time(samples: Sequence[MetricSample]) -> float | None:
    """Typical seconds per step: the nodes' window averages, else the observed step rate."""
    latest = samples[-1] if samples else None
    if latest is not None and latest.step_time:
        return statistics.median(latest.step_time.values())
    pts = [p for p in by_step(samples) if p.last_step_ts is not None]
    rates = [
        (b.last_step_ts - a.last_step_ts) / (b.step - a.step)  # type: ignore[operator]
        for a, b in itertools.pairwise(pts)
        if b.step != a.step
    ]
    return statistics.median(rates) if rates else None


#: A job may take this many hang floors from start to its first step (imports, rendezvous,
#: checkpoint load) before it counts as hung at startup, unless the run has shown how long
#: its startups take: then STARTUP_MARGIN × the slowest one, at least two floors.
STARTUP_FLOORS = 10


STARTUP_MARGIN = 3.0


def startup_limit(rc: RecoverySpec, seen: float | None) -> float:
    """Seconds from start to first step before a job counts as hung at startup."""
    default = STARTUP_FLOORS * rc.hang_floor_seconds
    if seen is None or seen <= 0:
        return default
    return min(default, max(2 * rc.hang_floor_seconds, STARTUP_MARGIN * seen))


def detect_startup_hang(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Running for `startup_limit` (10 hang floors, or 3 × the run's slowest startup seen)
    without finishing a first step.

    Needs SLURM's word that the job runs and a metrics source that answered (UP, or up with
    no series for the run yet); a failed or stale source convicts nothing."""
    if not job_running(snap) or snap.attempt_started_at is None:
        return []
    if snap.metrics.health not in (SourceHealth.UP, SourceHealth.MISSING):
        return []
    if any(s.last_step_ts for s in snap.metrics.samples):
        return []
    waited = snap.now - snap.attempt_started_at
    limit = startup_limit(rc, snap.startup_seconds_seen)
    if waited <= limit:
        return []
    return [
        _hang_finding(
            snap,
            f"no first step {waited:.0f} s after the job started (limit {limit:.0f} s)",
            {
                "waited_seconds": waited,
                "limit_seconds": limit,
                "metrics": snap.metrics.health.value,
            },
            fault_time=snap.attempt_started_at,
        )
    ]


def detect_hang(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """No step finished for max(hang_factor × median step time, floor) while the job runs.

    Every rank stalls in the collective, so the job's nodes (in the evidence) say nothing
    about which one hung; the node that never began the step does (`hung_nodes`), and so
    does a node gone dark while its peers stood still (`silent_hung_nodes`): the hang is then
    that node's. Without one, the policy intersects the hung attempts' nodes.

    A node whose processes exited (its host refused the scrape) is no one's fault: its rank
    crashed and took the node's exporter along, while the peers wait in a collective that
    will never end. That hang names nobody, and the cure is a restart.

    A silent node may be the one exporting the run's metrics, whose view then goes STALE:
    with the peers' stillness as evidence that is still a hang, not a blind spot. While a
    node fails its scrapes but not yet for DARK_AFTER_S, the verdict waits for it (at most that
    long: a flapping endpoint that never settles must not hold it off): judged earlier, a
    frozen host would be a hang that names nobody.

    Otherwise the stillness must be seen, not assumed: it counts up to the newest sample, not
    to now. After a blind spot (Prometheus restarted, its first scrapes not yet in) the newest
    sample still holds the step before it, and the gap is no evidence (judged as a hang, it
    would exclude a healthy node)."""
    if not job_running(snap) or not snap.metrics.samples:
        return []
    latest = snap.metrics.samples[-1]
    if latest.last_step_ts is None or latest.last_step_ts <= 0 or latest.up == 0:
        return []
    typical = median_step_time(snap.metrics.samples)
    limit = hang_limit(typical, rc)
    dark = silent_hung_nodes(snap, snap.metrics.dark_nodes, limit)
    exited = silent_hung_nodes(snap, snap.metrics.exited_nodes, limit)
    silent = dark or exited
    idle = (snap.now if silent else latest.t) - latest.last_step_ts
    if idle <= limit or not (metrics_ok(snap) or silent):
        return []
    waiting = set(snap.metrics.failing_nodes) & set(snap.job.nodes)
    if not silent and waiting and idle <= limit + DARK_AFTER_S:
        return []
    return [
        _hang_finding(
            snap,
            f"no step for {idle:.0f} s (limit {limit:.0f} s) after step {latest.step}",
            {"idle_seconds": idle, "limit_seconds": limit, "median_step_time": typical},
            dark=dark,
            exited=exited,
            fault_time=latest.last_step_ts,
            last_healthy_step=latest.step,
        )
    ]


def hang_limit(typical: float | None, rc: RecoverySpec) -> float:
    """Seconds without a step that make a hang: hang_factor × the typical step, at least
    the floor."""
    if not typical:
        return rc.hang_floor_seconds
    return max(rc.hang_factor * typical, rc.hang_floor_seconds)


def hang_due(snap: Snapshot, rc: RecoverySpec) -> float | None:
    """When (wall clock) `detect_hang` can first see a hang if no step comes: the limit after
    the last step, plus one scrape interval (the median gap between the view's samples) for
    a sample to show that stillness. None when the job does not run or no step was seen."""
    samples = snap.metrics.samples
    if not job_running(snap) or not samples:
        return None
    last = samples[-1].last_step_ts
    if last is None or last <= 0:
        return None
    gaps = [b.t - a.t for a, b in itertools.pairwise(samples) if b.t > a.t]
    scrape = statistics.median(gaps) if gaps else 0.0
    return last + hang_limit(median_step_time(samples), rc) + scrape


def _hang_finding(
    snap: Snapshot,
    summary: str,
    evidence: dict[str, Any],
    dark: tuple[str, ...] = (),
    exited: tuple[str, ...] = (),
    **fields: Any,
) -> Finding:
    """A hang, with the job's nodes as evidence, and blamed on the node that never began the
    step when the metrics name one (`hung_nodes`), else on the nodes gone dark (`dark`)."""
    lagging = hung_nodes(snap)
    hung = lagging or dark
    if lagging:
        summary += f"; {', '.join(lagging)} never began it"
    elif dark:
        summary += f"; {', '.join(dark)} went dark while its peers stood still"
    elif exited:
        summary += f"; the processes on {', '.join(exited)} exited while their peers waited"
    return Finding(
        kind=FindingKind.HANG,
        summary=summary,
        cause=Cause.NODE if hung else Cause.UNKNOWN,
        evidence={
            **evidence,
            "job_nodes": list(snap.job.nodes),
            "lagging_nodes": list(lagging),
            "dark_nodes": list(dark),
            "exited_nodes": list(exited),
            "peers_steady_seconds": snap.metrics.peers_steady_s,
        },
        nodes=hung,
        **fields,
    )


def hung_nodes(snap: Snapshot) -> tuple[str, ...]:
    """The job's nodes that had not begun the step their peers began, if some had: in a hang
    the peers wait inside that step's collectives for the node that never came."""
    job = set(snap.job.nodes)
    lagging = set(snap.metrics.lagging_nodes)
    if job:
        lagging &= job
    if not lagging or lagging == job:
        return ()
    return tuple(sorted(lagging))


def silent_hung_nodes(snap: Snapshot, silent: Sequence[str], limit: float) -> tuple[str, ...]:
    """The job's `silent` nodes (dark or exited) while the nodes still answering began no new
    step for half the hang limit: a frozen or dead host, or a crashed rank, stalls every
    collective it is in, long before SLURM's node timeout (minutes) or the collective's own
    timeout says so. Peers that move on clear it (a dead exporter or a cut-off scrape on a
    training node), and so does silence on every node (Prometheus's own trouble)."""
    job = set(snap.job.nodes)
    nodes = set(silent) & job
    steady = snap.metrics.peers_steady_s
    if not nodes or nodes == job or steady is None or steady < limit / 2:
        return ()
    return tuple(sorted(nodes))
