"""Progress faults: hangs (at start-up and in training), stragglers, throughput drops."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from contracts.spec import RecoverySpec
from supervisor.metrics_in import MetricSample, MetricsView, SourceHealth
from supervisor.metrics_in.samples import scrape_interval
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
        slow = slow_nodes(p.step_time, rc)
        ratios.update(slow)
        suspects = set(slow) if suspects is None else suspects & set(slow)
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


def slow_nodes(step_time: Mapping[str, float], rc: RecoverySpec) -> dict[str, float]:
    """Node → its step time / the median of the others', for the nodes above straggler_ratio."""
    slow = {}
    for node, t in step_time.items():
        ref = statistics.median(v for n, v in step_time.items() if n != node)
        if ref > 0 and t > rc.straggler_ratio * ref:
            slow[node] = t / ref
    return slow


def straggler_due(snap: Snapshot, rc: RecoverySpec) -> float | None:
    """When the next sample can add to a straggler verdict (`next_read`), while the newest
    samples show a slow node but fewer than the k in a row the verdict needs; None otherwise
    (a verdict made, or declined by the policy, asks for nothing more). The loop looks at
    each such sample as it comes instead of at its next tick."""
    if not metrics_ok(snap):
        return None
    streak = 0
    for sample in reversed(by_step(snap.metrics.samples)):
        if len(sample.step_time) < 2 or not slow_nodes(sample.step_time, rc):
            break
        streak += 1
    if not 0 < streak < rc.loss_spike_sustain_steps:
        return None
    return next_read(snap.metrics.samples, snap.now)


#: A sample can be read once its scrape has finished: a look for a sample comes this
#: fraction of a scrape interval after the sample's time (the scrape's start).
SAMPLE_SETTLE = 0.2


def next_read(samples: Sequence[MetricSample], after: float) -> float | None:
    """When the first sample taken after `after` can be read: scrapes go on at the view's
    interval from its newest sample (Prometheus scrapes each target at a fixed phase), and
    each is read SAMPLE_SETTLE of an interval after it was taken. None without an interval."""
    scrape = scrape_interval(samples)
    if scrape <= 0:
        return None
    newest = samples[-1].t
    taken = newest + max(1, math.floor((after - newest) / scrape) + 1) * scrape
    return taken + SAMPLE_SETTLE * scrape


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
#: checkpoint load), and at least STARTUP_MIN_S, before it counts as hung at startup, unless
#: the run has shown how long its startups take: then STARTUP_MARGIN × the slowest one, at
#: least two floors. The minimum keeps a floor sized for steps (seconds) off the first
#: start-up, whose imports alone take tens of seconds on a loaded machine.
STARTUP_FLOORS = 10
STARTUP_MIN_S = 60.0


STARTUP_MARGIN = 3.0


def startup_limit(rc: RecoverySpec, seen: float | None) -> float:
    """Seconds from start to first step before a job counts as hung at startup."""
    default = max(STARTUP_FLOORS * rc.hang_floor_seconds, STARTUP_MIN_S)
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
    """No step finished for the hang limit (`hang_limit`) while the job runs.

    Every rank stalls in the collective, so the job's nodes (in the evidence) say nothing
    about which one hung; the node that never began the step does (`hung_nodes`), and so
    does a node gone dark while its peers stood still (`silent_hung_nodes`): the hang is then
    that node's. Without one, the policy intersects the hung attempts' nodes.

    A loop waiting on a save that began after its last step (`saving`) is busy, not hung:
    its limit is at least `save_hang_seconds` then, unless a node went silent meanwhile; a
    save it published since its last step is progress (`last_progress`).

    A node whose processes exited (its host refused the scrape) is no one's fault: its rank
    crashed and took the node's exporter along, while the peers wait in a collective that
    will never end. That hang names nobody, and the cure is a restart.

    A silent node may be the one exporting the run's metrics, whose view then goes STALE:
    with the peers' stillness as evidence that is still a hang, not a blind spot. A frozen
    host shows only once a scrape of it times out, so a hang that names no node waits
    `unseen_host_s` past the limit; while a node fails its scrapes but not yet for the
    view's `dark_after_s`, the verdict waits that much longer for it (no more: a flapping
    endpoint that never settles must not hold it off). Judged earlier, a frozen host would be
    a hang that names nobody, restarted in place, where the job hangs on it again.

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
    gap = longest_gap(snap.metrics)
    limit = hang_limit(typical, rc, gap)
    dark = silent_hung_nodes(snap, snap.metrics.dark_nodes, limit)
    exited = silent_hung_nodes(snap, snap.metrics.exited_nodes, limit)
    silent = dark or exited
    if not silent and saving(latest):
        limit = max(limit, rc.save_hang_seconds)
    idle = (snap.now if silent else latest.t) - last_progress(latest)
    if idle <= limit or not (metrics_ok(snap) or silent):
        return []
    unseen = unseen_host_s(snap.metrics.samples)
    waiting = set(snap.metrics.failing_nodes) & set(snap.job.nodes)
    if not silent and waiting and idle <= limit + unseen + snap.metrics.dark_after_s:
        return []
    if not (silent or hung_nodes(snap)) and idle <= limit + unseen:
        return []
    return [
        _hang_finding(
            snap,
            f"no step for {idle:.0f} s (limit {limit:.0f} s) after step {latest.step}",
            {
                "idle_seconds": idle,
                "limit_seconds": limit,
                "median_step_time": typical,
                "longest_gap_seen": gap,
                "saving": saving(latest),
            },
            dark=dark,
            exited=exited,
            fault_time=last_progress(latest),
            last_healthy_step=latest.step,
        )
    ]


def last_progress(sample: MetricSample) -> float:
    """When the loop last showed progress: its last step, or a checkpoint it published since
    (a synchronous save is the loop's work between two steps; an exporter starved during
    it shows the end of the save and the old step in the same sample)."""
    step = sample.last_step_ts or 0.0
    return max(step, sample.checkpoint_ts or 0.0)


def saving(sample: MetricSample) -> bool:
    """The loop waits on a save that began after its last step (`save_hang_seconds`)."""
    began, last = sample.save_started_ts, sample.last_step_ts
    return bool(began and last and began >= last)


#: A frozen host shows only once a scrape of it times out: up to a scrape interval before
#: that scrape begins, and its timeout (at most an interval). A hang that names no node waits
#: this many intervals past the limit, so that such a host is seen failing (and waited for)
#: rather than restarted in place, where the restarted job hangs on it again.
SILENT_HOST_SCRAPES = 2


def unseen_host_s(samples: Sequence[MetricSample]) -> float:
    """How long a frozen host may go unseen by the scrapes (`SILENT_HOST_SCRAPES`)."""
    return SILENT_HOST_SCRAPES * scrape_interval(samples)


def hang_limit(typical: float | None, rc: RecoverySpec, gap: float | None = None) -> float:
    """Seconds without a step that make a hang: hang_factor × the typical step and
    hang_gap_factor × the longest gap between steps the run has shown, at least the floor.

    The floor alone must cover every pause a healthy run may make; with the gaps the run
    itself measured (saves, evaluations, stalls under load) the floor can be small and the
    limit still grows with what this run, on this machine, has come through."""
    limit = rc.hang_floor_seconds
    if typical:
        limit = max(limit, rc.hang_factor * typical)
    if gap:
        limit = max(limit, rc.hang_gap_factor * gap)
    return limit


def longest_gap(view: MetricsView) -> float | None:
    """The longest gap between two steps any of the run's processes in the view has shown
    (this attempt's samples and the earlier attempts' kept as `prior`)."""
    gaps = [
        s.step_gap_max
        for s in (*view.prior, *view.samples)
        if s.step_gap_max is not None and math.isfinite(s.step_gap_max) and s.step_gap_max > 0
    ]
    return max(gaps, default=None)


def hang_probe_at(snap: Snapshot, rc: RecoverySpec) -> tuple[float, float] | None:
    """When (wall clock) the hang limit after the newest step runs out, and that step's time:
    the moment to read the job's endpoints directly (`MetricSource.collect`'s `probe`)
    rather than wait up to a scrape interval for a sample that shows the stillness. None
    when the job does not run or no step was seen."""
    samples = snap.metrics.samples
    if not job_running(snap) or not samples:
        return None
    if not samples[-1].last_step_ts or samples[-1].last_step_ts <= 0:
        return None
    last = last_progress(samples[-1])
    return last + hang_limit(median_step_time(samples), rc, longest_gap(snap.metrics)), last


def hang_due(snap: Snapshot, rc: RecoverySpec) -> float | None:
    """When (wall clock) `detect_hang` can first see a hang if no step comes: when the first
    sample taken past the limit after the last step can be read (`next_read`); while one of
    the job's nodes fails its scrapes, no sooner than it settles as dark (the verdict waits
    for that); once that is past with no verdict, at each next sample, for as long as a
    frozen host could still show and settle. None when the job does not run, no step was
    seen, or nothing is coming."""
    runs_out = hang_probe_at(snap, rc)
    if runs_out is None:
        return None
    samples = snap.metrics.samples
    shown = next_read(samples, runs_out[0])
    if shown is None:
        return None
    due = shown
    settles = snap.metrics.dark_settles_at
    if settles is not None and set(snap.metrics.failing_nodes) & set(snap.job.nodes):
        due = max(due, settles)
    if due > snap.now:
        return due
    # Past due with no verdict: the sample showing the stillness may not be in yet, nor the
    # first failed scrape of a frozen host. Look at each sample as it comes while such a
    # verdict can still come; after that (a blind spot) the tick that is due will do.
    if snap.now < due + unseen_host_s(samples) + snap.metrics.dark_after_s:
        return next_read(samples, snap.now)
    return None


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
