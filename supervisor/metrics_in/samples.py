"""Samples from exposed metrics, and the trailing windows the watchdog judges them over."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from contracts.metric_names import exposed
from supervisor.metrics_in.types import (
    MetricSample,
    MetricsView,
    RunKey,
    SourceHealth,
    dark_after,
)

#: MetricSample field → exposed sample name (docs/contracts.md, "Metrics").
RUN_FIELDS: dict[str, str] = {
    "step": exposed("step"),
    "last_step_ts": exposed("last_step_timestamp_seconds"),
    "step_gap_max": exposed("step_gap_max_seconds"),
    "save_started_ts": exposed("save_started_timestamp_seconds"),
    "steps_total": exposed("steps"),
    "target_steps": exposed("target_steps"),
    "loss": exposed("loss"),
    "loss_sum": exposed("loss_summed"),
    "loss_window_max": exposed("loss_window_max"),
    "loss_window_min": exposed("loss_window_min"),
    "grad_norm": exposed("grad_norm"),
    "grad_norm_window_max": exposed("grad_norm_window_max"),
    "nonfinite_total": exposed("nonfinite_steps"),
    "tokens_total": exposed("tokens"),
    "tokens_per_second": exposed("tokens_per_second"),
    "samples_consumed": exposed("samples_consumed"),
    "checkpoint_step": exposed("checkpoint_step"),
    "checkpoint_ts": exposed("checkpoint_last_timestamp_seconds"),
    "checkpoint_failures_total": exposed("checkpoint_failures"),
    "replica_checks_total": exposed("replica_checks"),
    "replica_mismatches_total": exposed("replica_mismatches"),
    "up": exposed("up"),
    "eval_loss": exposed("eval_loss"),
    "eval_step": exposed("eval_step"),
    "eval_resumed_loss": exposed("eval_resumed_loss"),
}
STEP_TIME = exposed("step_time_window_avg_seconds")
NONFINITE_GRADS = exposed("nonfinite_grads")
STEP_ENTERED = exposed("step_entered")
#: The run-level metrics come from the node that exports this one (global rank 0's).
PRIMARY_MARKER = exposed("loss")

#: A failed scrape quicker than this was refused: the host answered, but nothing listened
#: (the node's training processes exited, as after a rank crash). A frozen or dead host
#: answers nothing, and its scrape fails at the scrape timeout (1 s and more).
REFUSED_WITHIN_S = 0.25
_INT_FIELDS = frozenset(
    {"step", "target_steps", "samples_consumed", "checkpoint_step", "eval_step"}
)
_NAME_TO_FIELD = {name: f for f, name in RUN_FIELDS.items()}


def build_sample(
    t: float, values: Mapping[str, float], step_time: Mapping[str, float]
) -> MetricSample:
    """A MetricSample from exposed-name → value (unknown names ignored)."""
    fields: dict[str, Any] = {}
    for name, value in values.items():
        field = _NAME_TO_FIELD.get(name)
        if field is None:
            continue
        if field in _INT_FIELDS:
            if not math.isfinite(value):
                continue
            fields[field] = int(value)
        else:
            fields[field] = value
    return MetricSample(t=t, step_time=dict(step_time), **fields)


#: The newest samples whose gaps make a view's scrape interval (`scrape_interval`).
SCRAPE_INTERVAL_SAMPLES = 16


def scrape_interval(samples: Sequence[MetricSample]) -> float:
    """The median gap between the newest SCRAPE_INTERVAL_SAMPLES samples (0 with fewer than
    two): how often the source sees the run, which the dark time and the detectors' read
    times follow."""
    recent = samples[-SCRAPE_INTERVAL_SAMPLES:]
    gaps = [b.t - a.t for a, b in itertools.pairwise(recent) if b.t > a.t]
    return statistics.median(gaps) if gaps else 0.0


#: Earlier attempts' samples kept per run as a fresh attempt's loss baseline.
PRIOR_SAMPLES = 256


def _first_step(samples: Iterable[MetricSample]) -> int | None:
    """The first step an attempt completed (placeholders before its first step excluded)."""
    return next((s.step for s in samples if s.step is not None and s.last_step_ts), None)


def _chain(
    prior: Iterable[MetricSample], later: Sequence[MetricSample]
) -> tuple[MetricSample, ...]:
    """One step-ordered history: `prior` below `later`'s first step, then `later` (capped)."""
    first = _first_step(later)
    kept = [s for s in prior if first is None or (s.step is not None and s.step < first)]
    return (*kept, *later)[-PRIOR_SAMPLES:]


class SampleHistory:
    """Trailing window of samples per (run, attempt); the sources' only state.

    Why keep history at all: a scrape is a point, while the spike detector needs a window.
    Losing it (supervisor restart) only delays judgement: an empty window convicts nothing.
    When a run moves to a new attempt, the old attempt's samples become that run's `prior`
    (see `MetricsView.prior`), capped at PRIOR_SAMPLES.
    """

    def __init__(self, window_s: float, stale_after_s: float) -> None:
        self.window_s = window_s
        self.stale_after_s = stale_after_s
        self._samples: dict[RunKey, deque[MetricSample]] = {}
        self._prior: dict[str, tuple[MetricSample, ...]] = {}
        self._nonfinite_nodes: dict[RunKey, frozenset[str]] = {}
        self._lagging_nodes: dict[RunKey, tuple[str, ...]] = {}
        self._dark_since: dict[RunKey, dict[str, float]] = {}
        self._refused: dict[RunKey, frozenset[str]] = {}
        self._peer_step: dict[RunKey, tuple[float, float]] = {}

    def add(self, key: RunKey, sample: MetricSample) -> None:
        buf = self._samples.setdefault(key, deque())
        if buf and sample.t <= buf[-1].t:
            if sample.t == buf[-1].t:
                buf[-1] = sample
            return
        buf.append(sample)

    def add_nonfinite_nodes(self, key: RunKey, nodes: Iterable[str]) -> None:
        """Nodes seen with non-finite local gradients (a counter: once seen, kept)."""
        nodes = frozenset(nodes)
        if nodes:
            self._nonfinite_nodes[key] = self._nonfinite_nodes.get(key, frozenset()) | nodes

    def set_lagging_nodes(self, lagging: Mapping[RunKey, Iterable[str]]) -> None:
        """The nodes behind their peers at this answer (a gauge: replaced every tick)."""
        self._lagging_nodes = {k: tuple(sorted(set(v))) for k, v in lagging.items() if v}

    def set_dark(
        self,
        failing: Mapping[RunKey, Mapping[str, float]],
        peer_steps: Mapping[RunKey, float],
        now: float,
        first_failed: Mapping[RunKey, Mapping[str, float]] | None = None,
    ) -> None:
        """The nodes whose endpoint failed at this answer, with how long that scrape took
        (failing from `first_failed`, the source's time of the streak's first failed scrape,
        else from the first answer that showed it so, until one shows it answering),
        and the furthest step the answering nodes of such an attempt had begun (steady from
        the first answer with that value)."""
        since: dict[RunKey, dict[str, float]] = {}
        for key, nodes in failing.items():
            seen = self._dark_since.get(key, {})
            first = (first_failed or {}).get(key, {})
            since[key] = {n: first.get(n, seen.get(n, now)) for n in nodes}
        self._dark_since = {k: v for k, v in since.items() if v}
        self._refused = {
            key: frozenset(n for n, s in nodes.items() if s < REFUSED_WITHIN_S)
            for key, nodes in failing.items()
        }
        steps: dict[RunKey, tuple[float, float]] = {}
        for key, step in peer_steps.items():
            seen_step = self._peer_step.get(key)
            steps[key] = seen_step if seen_step and seen_step[0] == step else (step, now)
        self._peer_step = steps

    def _dark(self, key: RunKey, now: float) -> dict[str, Any]:
        """The view's nodes failing their scrapes: dark or exited once they have for
        `dark_after` of the key's scrape interval, failing before; and how long their peers
        stood still."""
        since = self._dark_since.get(key, {})
        after = dark_after(scrape_interval(tuple(self._samples.get(key, ()))))
        settled = {n for n, t in since.items() if now - t >= after}
        refused = self._refused.get(key, frozenset())
        peer = self._peer_step.get(key)
        pending = [t + after for n, t in since.items() if n not in settled]
        return {
            "dark_nodes": tuple(sorted(settled - refused)),
            "exited_nodes": tuple(sorted(settled & refused)),
            "failing_nodes": tuple(sorted(set(since) - settled)),
            "peers_steady_s": now - peer[1] if settled and peer else None,
            "dark_after_s": after,
            "dark_settles_at": min(pending, default=None),
        }

    def view(self, key: RunKey, now: float, health: SourceHealth = SourceHealth.UP) -> MetricsView:
        """The key's window; UP only when the source answered and its newest sample is fresh."""
        buf = self._samples.get(key)
        while buf and buf[0].t < now - self.window_s:
            buf.popleft()
        samples = tuple(buf) if buf else ()
        if health is not SourceHealth.UP:
            return MetricsView(health=health, samples=samples)
        if not samples:
            return MetricsView(health=SourceHealth.MISSING)
        if now - samples[-1].t > self.stale_after_s:
            age = now - samples[-1].t
            return MetricsView(
                SourceHealth.STALE,
                samples,
                f"newest sample {age:.1f} s old",
                **self._dark(key, now),
            )
        return MetricsView(
            SourceHealth.UP,
            samples,
            prior=self._prior_below(key[0], samples),
            nonfinite_grad_nodes=tuple(sorted(self._nonfinite_nodes.get(key, ()))),
            lagging_nodes=self._lagging_nodes.get(key, ()),
            **self._dark(key, now),
        )

    def _prior_below(
        self, run_id: str, samples: tuple[MetricSample, ...]
    ) -> tuple[MetricSample, ...]:
        """Earlier attempts' samples at steps below this attempt's first (those above it were
        rolled back or redone, and may be the very fault that caused the restart)."""
        prior = self._prior.get(run_id)
        if not prior:
            return ()
        first = _first_step(samples)
        if first is None:
            return ()
        return tuple(s for s in prior if s.step is not None and s.step < first)

    def newest(self) -> dict[RunKey, float]:
        """Time of the newest sample held per key (what a source need not rebuild)."""
        return {k: buf[-1].t for k, buf in self._samples.items() if buf}

    def forget_except(self, keys: Iterable[RunKey]) -> None:
        """Drop keys no longer watched; a run's superseded attempt becomes its prior."""
        current = dict(keys)
        for key in [k for k in self._nonfinite_nodes if current.get(k[0]) != k[1]]:
            del self._nonfinite_nodes[key]
        for key in [k for k in self._samples if current.get(k[0]) != k[1]]:
            buf = self._samples.pop(key)
            run_id, attempt = key
            if current.get(run_id, 0) > attempt:
                self._prior[run_id] = _chain(self._prior.get(run_id, ()), buf)
        for run_id in [r for r in self._prior if r not in current]:
            del self._prior[run_id]
