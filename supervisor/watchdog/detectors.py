"""Pure detectors: `(Snapshot, RecoverySpec) -> list[Finding]`, each with its evidence.

Rules every detector keeps:
- metrics-based detectors look only at an UP metrics view; stale, missing or failed data
  yields no finding (the policy reports it, nothing convicts or clears on it). The one
  exception is a hang whose staleness is itself the evidence: the node exporting the run's
  metrics went dark or exited while its peers, still answering, stood still
  (`silent_hung_nodes`);
- job-based detectors look only at an UP SLURM view;
- "sustained" is counted in distinct training steps, never in repeated scrapes of one step;
- the onset of a numeric fault is bounded by the last sample seen healthy (a NaN seen
  with none before it: by the process's count of non-finite steps).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from contracts import exitcodes
from contracts.metric_names import WINDOW_STEPS
from contracts.spec import RecoverySpec
from supervisor.metrics_in import DARK_AFTER_S, MetricSample, SourceHealth
from supervisor.models import AttemptState
from supervisor.watchdog.blame import classify_failure
from supervisor.watchdog.snapshot import Cause, Finding, FindingKind, Snapshot

#: Fewest baseline samples before a throughput drop can be judged at all.
MIN_BASELINE_SAMPLES = 5
#: Fewest training steps a loss baseline must have watched before a spike can be judged.
MIN_BASELINE_STEPS = 5
#: Fewest samples a loss baseline is made of when the step window holds fewer.
BASELINE_MIN_POINTS = 12
#: 1.4826 × MAD estimates the standard deviation of normal noise.
MAD_TO_SIGMA = 1.4826

Detector = Callable[[Snapshot, RecoverySpec], list[Finding]]


def _finite(x: float | None) -> bool:
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


def _job_running(snap: Snapshot) -> bool:
    """SLURM says the job runs and is not being torn down: a hang in a COMPLETING job is
    the teardown's, and its final state (NODE_FAIL, CANCELLED, ...) is the finding."""
    job = snap.job
    running = job.state is AttemptState.RUNNING
    return job.health is SourceHealth.UP and running and not job.completing


def _metrics_ok(snap: Snapshot) -> bool:
    return snap.metrics.health is SourceHealth.UP and bool(snap.metrics.samples)


def _window(a: MetricSample | None, b: MetricSample) -> tuple[int, int] | None:
    """Global samples consumed after observation `a` up to observation `b` (half-open)."""
    if a is None or a.samples_consumed is None or b.samples_consumed is None:
        return None
    lo, hi = a.samples_consumed, b.samples_consumed
    return (lo, hi) if hi > lo else None


def _onset_fields(healthy: MetricSample | None, first_bad: MetricSample) -> dict[str, object]:
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
        "sample_window": _window(healthy, first_bad),
    }


# --- numeric faults ---------------------------------------------------------------------------


def _is_nonfinite(s: MetricSample) -> bool:
    if s.nonfinite_total is not None and s.nonfinite_total > 0:
        return True
    values = (s.loss, s.grad_norm, s.loss_window_max, s.grad_norm_window_max)
    return any(v is not None and not math.isfinite(v) for v in values)


def detect_nonfinite(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """NaN/Inf loss or grad norm: one is enough (the nonfinite counter survives scrapes)."""
    if not _metrics_ok(snap):
        return []
    samples = snap.metrics.samples
    first = next((i for i, s in enumerate(samples) if _is_nonfinite(s)), None)
    if first is None:
        return []
    bad = samples[first]
    healthy = next((s for s in reversed(samples[:first]) if s.step is not None), None)
    latest = samples[-1]
    onset = _onset_fields(healthy, bad)
    if healthy is None:
        onset["first_bad_step"] = _counted_onset(bad)
    # A finite loss with non-finite grads: the forward pass on the data was fine, the
    # backward pass of some node was not.
    grads_only = _finite(bad.loss)
    nodes = _nodes_that_made_nan(snap) if grads_only else ()
    if (
        grads_only
        and not nodes
        and len(snap.job.nodes) > 1
        and snap.now - bad.t < rc.nan_attribution_wait_seconds
    ):
        return []  # each node's counter is scraped on its own: it may be a scrape behind
    after = f"after step {healthy.step if healthy else '?'}"
    return [
        Finding(
            kind=FindingKind.NONFINITE,
            summary=(
                f"non-finite gradients from {', '.join(nodes)} {after}"
                if nodes
                else f"non-finite loss/grad norm {after}"
            ),
            cause=Cause.NODE if nodes else Cause.DATA,
            nodes=nodes,
            evidence={
                "nonfinite_steps_total": latest.nonfinite_total,
                "loss": _json_float(latest.loss),
                "grad_norm": _json_float(latest.grad_norm),
                "first_bad_at": bad.t,
                "grads_only": grads_only,
                "nonfinite_grad_nodes": list(snap.metrics.nonfinite_grad_nodes),
            },
            **onset,  # type: ignore[arg-type]
        )
    ]


def _nodes_that_made_nan(snap: Snapshot) -> tuple[str, ...]:
    """The attempt's nodes whose own gradients went non-finite, when that singles some out:
    bad data on every node (or a one-node job) says nothing about any node."""
    named = set(snap.metrics.nonfinite_grad_nodes)
    attempt = set(snap.job.nodes)
    if named and named < attempt:
        return tuple(sorted(named))
    return ()


def _counted_onset(bad: MetricSample) -> int | None:
    """The latest step the onset can be at when no healthy sample precedes `bad`.

    An attempt can go bad before its first scrape (a new target waits for discovery), so the
    first step seen bad may lie far past the onset, and a rollback to just before it would
    resume after the onset. The process counts its non-finite steps: k of them up to step s
    put the first at s - k + 1 or earlier."""
    if bad.step is None or not bad.nonfinite_total:
        return bad.step
    return max(1, min(bad.step, bad.step - int(bad.nonfinite_total) + 1))


def _json_float(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return str(x)


def spike_threshold(losses: Sequence[float], rc: RecoverySpec) -> tuple[float, float, float]:
    """(threshold, median, mad): a loss must beat both median + f·σ̂ and ratio × median."""
    med = statistics.median(losses)
    mad = statistics.median(abs(x - med) for x in losses)
    thr = max(med + rc.loss_spike_mad_factor * MAD_TO_SIGMA * mad, rc.loss_spike_ratio * med)
    return thr, med, mad


def _elevated_steps(episode: Sequence[MetricSample], thr: float, after_step: int) -> set[int]:
    """Steps known to be above `thr`: a sample's own step, or its whole window if even the
    window minimum is above (so a spike between two scrapes counts its real length)."""
    steps: set[int] = set()
    for s in episode:
        assert s.step is not None
        if _finite(s.loss) and s.loss > thr:  # type: ignore[operator]
            steps.add(s.step)
        if _finite(s.loss_window_min) and s.loss_window_min > thr:  # type: ignore[operator]
            lo = max(after_step + 1, s.step - WINDOW_STEPS + 1)
            steps.update(range(lo, s.step + 1))
    return steps


def _trailing_episode(
    points: Sequence[MetricSample], is_high: Callable[[MetricSample], bool]
) -> int | None:
    """Index where the trailing run of high samples starts (None: the last sample is fine)."""
    start = None
    for i in range(len(points) - 1, -1, -1):
        if not is_high(points[i]):
            break
        start = i
    return start


def _steps_seen(points: Sequence[MetricSample], first_own: int = 0) -> int:
    """Training steps whose loss `points` watched: each sample its own step, and through its
    window gauges the steps since the previous sample (at most the window's length). Why:
    with many steps per scrape, a handful of samples has watched every step, and a baseline
    needs steps watched, not scrapes. A sample opening a segment (the first, or this
    attempt's first after the prior) counts its own step only: its process's window may
    not reach back to the previous sample."""
    seen = 0
    for i, p in enumerate(points):
        if i in (0, first_own) or not _finite(p.loss_window_min):
            seen += 1
        else:
            seen += max(1, min((p.step or 0) - (points[i - 1].step or 0), WINDOW_STEPS))
    return seen


def _baseline(points: Sequence[MetricSample], end: int, rc: RecoverySpec) -> list[MetricSample]:
    """The trailing `loss_spike_window` steps before index `end`; when scrapes are sparse
    (few samples in that many steps), the last BASELINE_MIN_POINTS samples instead."""
    head = points[:end]
    if not head:
        return []
    first_step = (head[-1].step or 0) - rc.loss_spike_window
    window = [p for p in head if (p.step or 0) >= first_step]
    return window if len(window) >= BASELINE_MIN_POINTS else list(head[-BASELINE_MIN_POINTS:])


def detect_loss_spike(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Loss above a robust baseline, sustained (see `_sustained_spike`), or a short spike far
    above everything in the trailing window (see `_hard_spike`)."""
    if not _metrics_ok(snap):
        return []
    own = [p for p in by_step(snap.metrics.samples) if _finite(p.loss)]
    if not own:
        return []
    resumed_at = own[0].step or 0
    below = [
        p for p in by_step(snap.metrics.prior) if _finite(p.loss) and (p.step or 0) < resumed_at
    ]
    # A far older lineage is no baseline: the loss window before the resume point, or its
    # last BASELINE_MIN_POINTS samples when scrapes are sparse (as `_baseline` does).
    since = resumed_at - rc.loss_spike_window
    prior = [p for p in below if (p.step or 0) >= since]
    if len(prior) < BASELINE_MIN_POINTS:
        prior = below[-BASELINE_MIN_POINTS:]
    points = prior + own
    first_own = len(prior)  # only this attempt's steps can convict: the prior is a baseline
    finding = _sustained_spike(points, rc, first_own) or _hard_spike(points, rc, first_own)
    if finding is None:
        return []
    started = snap.attempt_started_at
    if prior and finding.last_healthy_step == prior[-1].step and started is not None:
        # Bad from this attempt's first sample: the fault came after it started, not at the
        # previous attempt's last healthy step (which would count the restart as downtime).
        finding = dataclasses.replace(finding, fault_time=max(finding.fault_time or 0, started))
    return [finding]


def _window_max(p: MetricSample) -> float:
    """The highest loss the sample knows of: its window max (survives scrapes), else its loss."""
    return p.loss_window_max if _finite(p.loss_window_max) else p.loss  # type: ignore[return-value]


def _sustained_spike(
    points: Sequence[MetricSample], rc: RecoverySpec, first_own: int = 0
) -> Finding | None:
    """Loss above a robust baseline (median/MAD of the trailing window AND ratio × median),
    sustained for `loss_spike_sustain_steps` distinct steps, still high at the last sample."""
    window = _baseline(points, len(points), rc)

    def high(thr: float) -> Callable[[MetricSample], bool]:
        def is_high(p: MetricSample) -> bool:
            return p.loss > thr or _window_max(p) > thr  # type: ignore[operator]

        return is_high

    thr, med, mad = spike_threshold([p.loss for p in window], rc)  # type: ignore[misc]
    start = _trailing_episode(points, high(thr))
    if start is None:
        return None
    # Median/MAD shrug off a short spike; a long one would drag them up, so re-judge
    # against the trailing window that ends where the episode starts.
    baseline = _baseline(points, start, rc)
    if _steps_seen(baseline, first_own - (start - len(baseline))) < MIN_BASELINE_STEPS:
        return None
    thr, med, mad = spike_threshold([p.loss for p in baseline], rc)  # type: ignore[misc]
    start = _trailing_episode(points, high(thr))
    if start is None or start == 0 or start < first_own:
        return None
    healthy, episode = points[start - 1], points[start:]
    steps = _elevated_steps(episode, thr, healthy.step or 0)
    if len(steps) < rc.loss_spike_sustain_steps:
        return None
    latest = episode[-1]
    return Finding(
        kind=FindingKind.LOSS_SPIKE,
        summary=(
            f"loss {latest.loss:.3g} vs baseline median {med:.3g} "
            f"for {len(steps)} steps after step {healthy.step}"
        ),
        cause=Cause.DATA,
        evidence={
            "loss": latest.loss,
            "loss_window_max": latest.loss_window_max,
            "baseline_median": med,
            "baseline_mad": mad,
            "threshold": thr,
            "elevated_steps": len(steps),
            "baseline_samples": len(baseline),
        },
        **_onset_fields(healthy, episode[0]),  # type: ignore[arg-type]
    )


def _hard_spike(
    points: Sequence[MetricSample], rc: RecoverySpec, first_own: int = 0
) -> Finding | None:
    """Megatron's rule: a loss above `loss_spike_hard_factor` × the max of the trailing window
    is a spike at once. A 1-2 step spike is over before any sustain window fills, yet it is
    what a poisoned batch looks like. Unlike a sustained spike it is reported even once it has
    passed: with fast steps it may be visible in one scrape only, and the bad batch it marks is
    still worth skipping (Megatron acts on it too)."""
    latest = points[-1]
    factor = rc.loss_spike_hard_factor
    for i in range(max(1, first_own), len(points)):
        baseline = _baseline(points, i, rc)
        if _steps_seen(baseline, first_own - (i - len(baseline))) < MIN_BASELINE_STEPS:
            continue
        ref = max(p.loss for p in baseline)  # type: ignore[type-var]
        thr = factor * ref  # type: ignore[operator]
        if ref <= 0:
            continue
        healthy = points[i - 1]
        excess = _loss_excess(healthy, points[i], baseline, factor) if i > first_own else None
        if _window_max(points[i]) > thr:
            rule, summary = (
                "hard_factor",
                (
                    f"loss {_window_max(points[i]):.3g} > {factor:g} × trailing max {ref:.3g} "
                    f"after step {healthy.step}"
                ),
            )
        elif excess is not None:
            rule, summary = (
                "hard_factor_sum",
                (
                    f"steps {healthy.step}-{points[i].step} carried {excess:.3g} of loss above the "
                    f"trailing max {ref:.3g}: more than one step at {factor:g} × it"
                ),
            )
        else:
            continue
        return Finding(
            kind=FindingKind.LOSS_SPIKE,
            summary=summary,
            cause=Cause.DATA,
            evidence={
                "loss": latest.loss,
                "loss_window_max": latest.loss_window_max,
                "trailing_max": ref,
                "threshold": thr,
                "rule": rule,
                "baseline_samples": len(baseline),
            },
            **_onset_fields(healthy, points[i]),  # type: ignore[arg-type]
        )
    return None


def _loss_excess(
    before: MetricSample, after: MetricSample, baseline: Sequence[MetricSample], factor: float
) -> float | None:
    """The loss that the steps no scrape's window saw carried above the baseline's highest
    loss, when it is more than one step at `factor` × that loss would carry (else None).

    The trainer's loss window covers its last WINDOW_STEPS steps, so when two scrapes
    of one process are further apart the steps before the later window pass unseen by it, but
    not by the `loss_sum` and `steps_total` counters. The window's steps carry at most its max
    each; what the rest carried above the baseline's highest loss sums a run's noise to about
    nothing, so an excess worth a hard spike is one (or several steps as bad together),
    wherever it fell. Non-finite losses add nothing to `loss_sum`."""
    counters = (before.loss_sum, before.steps_total, after.loss_sum, after.steps_total)
    if not all(_finite(c) for c in counters):
        return None
    steps = int(after.steps_total - before.steps_total)  # type: ignore[operator]
    unseen = steps - WINDOW_STEPS
    if unseen <= 0:
        return None
    highest = max(_window_max(p) for p in baseline)
    carried = after.loss_sum - before.loss_sum  # type: ignore[operator]
    excess = carried - WINDOW_STEPS * _window_max(after) - unseen * highest
    return excess if excess > (factor - 1) * highest else None


def detect_grad_explosion(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Grad norm above `grad_norm_max` for `loss_spike_sustain_steps` distinct steps."""
    if not _metrics_ok(snap):
        return []
    limit = rc.grad_norm_max
    points = [p for p in by_step(snap.metrics.samples) if _finite(p.grad_norm)]

    def is_high(p: MetricSample) -> bool:
        wmax = p.grad_norm_window_max if _finite(p.grad_norm_window_max) else p.grad_norm
        return p.grad_norm > limit or wmax > limit  # type: ignore[operator]

    start = _trailing_episode(points, is_high)
    if start is None:
        return []
    healthy = points[start - 1] if start > 0 else None
    episode = points[start:]
    steps = {p.step for p in episode if p.grad_norm > limit}  # type: ignore[operator]
    if len(steps) < rc.loss_spike_sustain_steps:
        return []
    latest = episode[-1]
    return [
        Finding(
            kind=FindingKind.GRAD_EXPLOSION,
            summary=f"grad norm {latest.grad_norm:.3g} > {limit:g} for {len(steps)} steps",
            cause=Cause.DATA,
            evidence={
                "grad_norm": latest.grad_norm,
                "grad_norm_window_max": latest.grad_norm_window_max,
                "limit": limit,
                "elevated_steps": len(steps),
            },
            **_onset_fields(healthy, episode[0]),  # type: ignore[arg-type]
        )
    ]


# --- performance and liveness -----------------------------------------------------------------


def detect_throughput_drop(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Tokens/s of the last k steps all below ratio × the attempt's own median."""
    if not _metrics_ok(snap):
        return []
    k = rc.loss_spike_sustain_steps
    points = [p for p in by_step(snap.metrics.samples) if _finite(p.tokens_per_second)]
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
    if not _metrics_ok(snap):
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
    if not _job_running(snap) or snap.attempt_started_at is None:
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
    if not _job_running(snap) or not snap.metrics.samples:
        return []
    latest = snap.metrics.samples[-1]
    if latest.last_step_ts is None or latest.last_step_ts <= 0 or latest.up == 0:
        return []
    typical = median_step_time(snap.metrics.samples)
    limit = rc.hang_floor_seconds
    if typical:
        limit = max(rc.hang_factor * typical, limit)
    dark = silent_hung_nodes(snap, snap.metrics.dark_nodes, limit)
    exited = silent_hung_nodes(snap, snap.metrics.exited_nodes, limit)
    silent = dark or exited
    idle = (snap.now if silent else latest.t) - latest.last_step_ts
    if idle <= limit or not (_metrics_ok(snap) or silent):
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


def detect_replica_mismatch(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Replicas that should be bit-identical differ: silent data corruption or a seeding bug."""
    if not _metrics_ok(snap):
        return []
    samples = snap.metrics.samples
    first = next((i for i, s in enumerate(samples) if (s.replica_mismatches_total or 0) > 0), None)
    if first is None:
        return []
    healthy = samples[first - 1] if first > 0 else None
    latest = samples[-1]
    return [
        Finding(
            kind=FindingKind.REPLICA_MISMATCH,
            summary=f"{latest.replica_mismatches_total:g} replica checksum mismatches",
            cause=Cause.UNKNOWN,
            evidence={
                "mismatches": latest.replica_mismatches_total,
                "checks": latest.replica_checks_total,
            },
            **_onset_fields(healthy, samples[first]),  # type: ignore[arg-type]
            nodes=snap.job.nodes,
        )
    ]


def detect_checkpoint_problems(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Failed saves, and checkpoints falling behind: more than factor × interval steps old."""
    if not _metrics_ok(snap):
        return []
    latest = snap.metrics.samples[-1]
    out: list[Finding] = []
    if (latest.checkpoint_failures_total or 0) > 0:
        out.append(
            Finding(
                kind=FindingKind.CHECKPOINT_FAILURE,
                summary=f"{latest.checkpoint_failures_total:g} checkpoint saves failed",
                cause=Cause.INFRA,
                evidence={"failures": latest.checkpoint_failures_total},
                fault_time=latest.t,
            )
        )
    # A resumed process exports 0 until its first save: the checkpoint it resumed from, on
    # disk, counts as well.
    saved = [c for c in (latest.checkpoint_step, snap.disk_checkpoint_step) if c is not None]
    if latest.step is not None and saved:
        behind = latest.step - max(saved)
        limit = rc.checkpoint_stall_factor * snap.checkpoint_interval_steps
        if behind > limit:
            out.append(
                Finding(
                    kind=FindingKind.CHECKPOINT_STALL,
                    summary=f"newest checkpoint is {behind} steps old (limit {limit:.0f})",
                    cause=Cause.INFRA,
                    evidence={
                        "step": latest.step,
                        "checkpoint_step": max(saved),
                        "checkpoint_ts": latest.checkpoint_ts,
                    },
                    fault_time=latest.t,
                    last_healthy_step=max(saved),
                )
            )
    return out


# --- SLURM ------------------------------------------------------------------------------------

_JOB_FINDINGS: dict[AttemptState, tuple[FindingKind, Cause]] = {
    AttemptState.NODE_FAIL: (FindingKind.JOB_NODE_FAIL, Cause.NODE),
    AttemptState.PREEMPTED: (FindingKind.JOB_PREEMPTED, Cause.INFRA),
    AttemptState.TIMEOUT: (FindingKind.JOB_TIMEOUT, Cause.INFRA),
    AttemptState.OUT_OF_MEMORY: (FindingKind.JOB_OOM, Cause.CODE),
    AttemptState.CANCELLED: (FindingKind.JOB_CANCELLED, Cause.UNKNOWN),
    AttemptState.LOST: (FindingKind.JOB_LOST, Cause.UNKNOWN),
}


def detect_job_state(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Terminal or bad SLURM states of the current attempt's job."""
    job = snap.job
    if job.health is not SourceHealth.UP or job.state is None:
        return []
    evidence = {
        "job_id": job.job_id,
        "state": job.state.value,
        "exit_code": job.exit_code,
        "reason": job.reason,
        "nodes": list(job.nodes),
    }
    step = snap.disk_checkpoint_step
    if job.state is AttemptState.COMPLETED:
        if step is None or snap.target_steps is None or step >= snap.target_steps:
            return []
        return [
            Finding(
                kind=FindingKind.JOB_ENDED_EARLY,
                summary=f"job ended at checkpoint {step} of {snap.target_steps}: continue",
                cause=Cause.INFRA,
                evidence=evidence,
                fault_time=snap.now,
                last_healthy_step=step,
            )
        ]
    summary = f"job {job.job_id} {job.state.value}" + (f": {job.reason}" if job.reason else "")
    if job.state is AttemptState.FAILED and job.exit_code == exitcodes.REQUEUE:
        # The trainer checkpointed on SLURM's TERM or USR2 and asked to be requeued: a
        # preemption or a walltime warning, not a failure (SLURM can only say FAILED 75).
        kind, cause = FindingKind.JOB_PREEMPTED, Cause.INFRA
        summary = f"job {job.job_id} checkpointed on a stop signal (exit 75): requeue"
    elif job.state is AttemptState.FAILED and job.exit_code == exitcodes.NO_GPU:
        # The job was given GPUs and a rank saw fewer: the node or the cluster's GPU set-up is
        # wrong, and the same request would fail the same way.
        kind, cause = FindingKind.JOB_NO_GPU, Cause.CODE
        summary = f"job {job.job_id}: a rank found no GPU (exit {exitcodes.NO_GPU})" + (
            f": {job.reason}" if job.reason else ""
        )
    elif job.state is AttemptState.FAILED:
        cause = job.cause or classify_failure(job.exit_code, job.reason)
        kind = FindingKind.JOB_FAILED
    elif job.state in _JOB_FINDINGS:
        kind, cause = _JOB_FINDINGS[job.state]
    else:
        return []
    # Only nodes SLURM names as failed are blamed directly; the policy infers the rest.
    nodes = job.failed_nodes
    return [
        Finding(
            kind=kind,
            summary=summary,
            cause=cause,
            evidence=evidence,
            fault_time=snap.now,
            last_healthy_step=step,
            nodes=nodes,
        )
    ]


ALL_DETECTORS: tuple[Detector, ...] = (
    detect_job_state,
    detect_nonfinite,
    detect_loss_spike,
    detect_grad_explosion,
    detect_hang,
    detect_startup_hang,
    detect_replica_mismatch,
    detect_straggler,
    detect_checkpoint_problems,
    detect_throughput_drop,
)


def detect_all(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Every detector's findings, most urgent first (the order of ALL_DETECTORS)."""
    return [f for detector in ALL_DETECTORS for f in detector(snap, rc)]
