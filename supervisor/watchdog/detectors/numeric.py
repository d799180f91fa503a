"""Numeric faults: non-finite loss or gradients, loss spikes, exploding gradient norms."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from contracts.metric_names import WINDOW_STEPS
from contracts.spec import RecoverySpec
from supervisor.metrics_in import MetricSample
from supervisor.watchdog.detectors.common import (
    BASELINE_MIN_POINTS,
    MAD_TO_SIGMA,
    MIN_BASELINE_STEPS,
    by_step,
    finite,
    json_float,
    metrics_ok,
    onset_fields,
)
from supervisor.watchdog.detectors.trainer import explained_nonfinite, spike_recorded_after
from supervisor.watchdog.snapshot import Cause, Finding, FindingKind, Snapshot


def _is_nonfinite(s: MetricSample) -> bool:
    if s.nonfinite_total is not None and s.nonfinite_total > 0:
        return True
    values = (s.loss, s.grad_norm, s.loss_window_max, s.grad_norm_window_max)
    return any(v is not None and not math.isfinite(v) for v in values)


def detect_nonfinite(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """NaN/Inf loss or grad norm: one is enough (the nonfinite counter survives scrapes)."""
    if not metrics_ok(snap):
        return []
    samples = snap.metrics.samples
    first = next((i for i, s in enumerate(samples) if _is_nonfinite(s)), None)
    if first is None:
        return []
    counted = max((s.nonfinite_total or 0 for s in samples), default=0)
    if snap.anomalies and explained_nonfinite(snap) >= max(1, counted):
        return []  # the trainer's record names every such step (detect_trainer_anomalies)
    bad = samples[first]
    healthy = next((s for s in reversed(samples[:first]) if s.step is not None), None)
    latest = samples[-1]
    onset = onset_fields(healthy, bad)
    if healthy is None:
        onset["first_bad_step"] = _counted_onset(bad)
    # A finite loss with non-finite grads: the forward pass on the data was fine, the
    # backward pass of some node was not.
    grads_only = finite(bad.loss)
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
                "loss": json_float(latest.loss),
                "grad_norm": json_float(latest.grad_norm),
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
        if finite(s.loss) and s.loss > thr:  # type: ignore[operator]
            steps.add(s.step)
        if finite(s.loss_window_min) and s.loss_window_min > thr:  # type: ignore[operator]
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
    return _window_seen(_seen_prefix(points, first_own), 0, len(points))


def _seen_prefix(points: Sequence[MetricSample], first_own: int = 0) -> list[int]:
    """`cum[k]`: the steps samples 1..k add to a window that opens at sample 0, so that any
    window `points[j:i]` watched `_window_seen(cum, j, i)` steps (`_steps_seen`): the hard
    spike rule asks it of every sample's trailing window, once each."""
    cum = [0]
    for k in range(1, len(points)):
        p = points[k]
        if k == first_own or not finite(p.loss_window_min):
            cum.append(cum[-1] + 1)
        else:
            gap = (p.step or 0) - (points[k - 1].step or 0)
            cum.append(cum[-1] + max(1, min(gap, WINDOW_STEPS)))
    return cum


def _window_seen(cum: Sequence[int], j: int, i: int) -> int:
    """The steps the window `points[j:i]` watched, from `_seen_prefix`: its first sample's own
    step, and what each later one adds."""
    return 1 + cum[i - 1] - cum[j] if i > j else 0


def _baseline_starts(points: Sequence[MetricSample], rc: RecoverySpec) -> list[int]:
    """`starts[i]`: where the baseline of index `i` begins (`_baseline`), for every `i` at
    once: the trailing `loss_spike_window` steps, or the last BASELINE_MIN_POINTS samples
    when scrapes are sparse. The steps rise, so each window starts at or after the one
    before."""
    starts = [0]
    j = 0
    for i in range(1, len(points) + 1):
        first_step = (points[i - 1].step or 0) - rc.loss_spike_window
        while (points[j].step or 0) < first_step:
            j += 1
        starts.append(j if i - j >= BASELINE_MIN_POINTS else max(0, i - BASELINE_MIN_POINTS))
    return starts


def _baseline(points: Sequence[MetricSample], end: int, rc: RecoverySpec) -> list[MetricSample]:
    """The trailing `loss_spike_window` steps before index `end`; when scrapes are sparse
    (few samples in that many steps), the last BASELINE_MIN_POINTS samples instead."""
    head = points[:end]
    return list(head[_baseline_starts(head, rc)[-1] :])


def detect_loss_spike(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Loss above a robust baseline, sustained (see `_sustained_spike`), or a short spike far
    above everything in the trailing window (see `_hard_spike`)."""
    if not metrics_ok(snap):
        return []
    own = [p for p in by_step(snap.metrics.samples) if finite(p.loss)]
    if not own:
        return []
    resumed_at = own[0].step or 0
    below = [
        p for p in by_step(snap.metrics.prior) if finite(p.loss) and (p.step or 0) < resumed_at
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
    if finding is None or spike_recorded_after(snap, finding.last_healthy_step):
        return []  # none, or the trainer's exact record of it decides (detect_trainer_anomalies)
    started = snap.attempt_started_at
    if prior and finding.last_healthy_step == prior[-1].step and started is not None:
        # Bad from this attempt's first sample: the fault came after it started, not at the
        # previous attempt's last healthy step (which would count the restart as downtime).
        finding = dataclasses.replace(finding, fault_time=max(finding.fault_time or 0, started))
    return [finding]


def _window_max(p: MetricSample) -> float:
    """The highest loss the sample knows of: its window max (survives scrapes), else its loss."""
    return p.loss_window_max if finite(p.loss_window_max) else p.loss  # type: ignore[return-value]


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
        **onset_fields(healthy, episode[0]),  # type: ignore[arg-type]
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
    starts, cum = _baseline_starts(points, rc), _seen_prefix(points, first_own)
    losses = [p.loss for p in points]
    for i in range(max(1, first_own), len(points)):
        j = starts[i]  # the trailing window is points[j:i] (`_baseline`)
        if _window_seen(cum, j, i) < MIN_BASELINE_STEPS:
            continue
        baseline = points[j:i]
        ref = max(losses[j:i])  # type: ignore[type-var]
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
            **onset_fields(healthy, points[i]),  # type: ignore[arg-type]
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
    if not all(finite(c) for c in counters):
        return None
    steps = int(after.steps_total - before.steps_total)  # type: ignore[operator]
    unseen = steps - WINDOW_STEPS
    if unseen <= 0:
        return None
    highest = max(_window_max(p) for p in baseline)
    carried = after.loss_sum - before.loss_sum  # type: ignore[operator]
    excess = carried - WINDOW_STEPS * _window_max(after) - unseen * highest
    return excess if excess > (factor - 1) * highest else None


#: Steps from scratch (or the LR warmup, if longer) whose gradient norm is the model's
#: initial transient: a 1.3B GPT's first steps on GPU show norms of 52, 44, 34, 4, 16, then
#: under 10 (docs/benchmarks.md).
GRAD_SETTLE_STEPS = 10


def initial_transient(episode_start: int, healthy: MetricSample | None, warmup: int) -> bool:
    """High norms from the first steps of a run from scratch, before any step below the limit:
    not an explosion (and a rollback could only restart the same steps from scratch)."""
    return healthy is None and episode_start <= max(GRAD_SETTLE_STEPS, warmup)


def detect_grad_explosion(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Grad norm above `grad_norm_max` for `loss_spike_sustain_steps` distinct steps, except
    in a run's `initial_transient`."""
    if not metrics_ok(snap):
        return []
    limit = rc.grad_norm_max
    points = [p for p in by_step(snap.metrics.samples) if finite(p.grad_norm)]

    def is_high(p: MetricSample) -> bool:
        wmax = p.grad_norm_window_max if finite(p.grad_norm_window_max) else p.grad_norm
        return p.grad_norm > limit or wmax > limit  # type: ignore[operator]

    start = _trailing_episode(points, is_high)
    if start is None:
        return []
    healthy = points[start - 1] if start > 0 else None
    episode = points[start:]
    steps = {p.step for p in episode if p.grad_norm > limit}  # type: ignore[operator]
    if len(steps) < rc.loss_spike_sustain_steps:
        return []
    assert episode[0].step is not None  # by_step keeps stepped samples
    if initial_transient(episode[0].step, healthy, snap.warmup_steps):
        return []
    if spike_recorded_after(snap, healthy.step if healthy else None):
        return []  # the gradients of a spike the trainer recorded: its record decides
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
            **onset_fields(healthy, episode[0]),  # type: ignore[arg-type]
        )
    ]
