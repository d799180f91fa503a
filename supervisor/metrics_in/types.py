"""What the watchdog and the report read from training metrics, whatever the source.

A `MetricsView` per (run, attempt) with a trailing window of samples and an honest health, so
detectors cannot tell a Prometheus answer from a direct scrape; `LossPoint`s for the report.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

RunKey = tuple[str, int]  # (run_id, attempt)

#: A node's endpoint must fail every scrape for DARK_AFTER_SCRAPES scrape intervals
#: (`samples.scrape_interval`), and at least DARK_AFTER_S, before it counts
#: as dark: one timed-out scrape of a busy exporter is not a dead host, and a fixed time
#: would be many scrapes at a fast interval and less than one at a slow one.
DARK_AFTER_SCRAPES = 2
DARK_AFTER_S = 2.0


class SourceHealth(enum.StrEnum):
    """How far an observation can be trusted. Only UP data may clear or convict a run."""

    UP = "up"
    DOWN = "down"  # the source failed (Prometheus / sacct unreachable, scrape error)
    STALE = "stale"  # the source answered but its newest data is too old
    MISSING = "missing"  # the source is up but has no series for this run yet


@dataclass(frozen=True, slots=True)
class MetricSample:
    """One observation of a run's worker metrics at time `t` (None = not exported)."""

    t: float
    step: int | None = None
    loss: float | None = None
    loss_window_max: float | None = None
    loss_window_min: float | None = None
    loss_sum: float | None = None
    steps_total: float | None = None
    grad_norm: float | None = None
    grad_norm_window_max: float | None = None
    nonfinite_total: float | None = None
    tokens_total: float | None = None
    tokens_per_second: float | None = None
    samples_consumed: int | None = None
    last_step_ts: float | None = None
    #: The longest gap between two consecutive steps the primary's process has shown.
    step_gap_max: float | None = None
    #: When the save the primary's loop waits on began (0: none).
    save_started_ts: float | None = None
    target_steps: int | None = None
    checkpoint_step: int | None = None
    checkpoint_ts: float | None = None
    checkpoint_failures_total: float | None = None
    replica_checks_total: float | None = None
    replica_mismatches_total: float | None = None
    up: float | None = None
    #: The attempt's last evaluation (None before its first) and the validation loss of the
    #: newest evaluation its resumed checkpoint recorded (NaN: none).
    eval_loss: float | None = None
    eval_step: int | None = None
    eval_resumed_loss: float | None = None
    step_time: Mapping[str, float] = field(default_factory=dict)  # node → window avg seconds


@dataclass(frozen=True, slots=True)
class MetricsView:
    """The trailing window of one attempt's samples, oldest first, with the source's health.

    `prior` holds the run's earlier attempts' samples below this attempt's first step: the
    loss baseline a fresh attempt would otherwise lack for its first scrapes, which is when
    a fault soon after a restart (a poisoned window near the resume point) must be judged."""

    health: SourceHealth
    samples: tuple[MetricSample, ...] = ()
    error: str | None = None
    prior: tuple[MetricSample, ...] = ()
    #: Nodes whose own gradients went non-finite before reduction in this attempt (each
    #: node's `nightwatch_train_nonfinite_grads_total`): after the reduction every rank holds
    #: the NaN, so only this says which node made it.
    nonfinite_grad_nodes: tuple[str, ...] = ()
    #: Nodes that, at the newest answer, had begun an earlier step than their peers
    #: (`nightwatch_train_step_entered`). While steps complete this is scrape skew; in a hang
    #: it is the node that never began the step its peers wait in.
    lagging_nodes: tuple[str, ...] = ()
    #: Nodes whose metrics endpoint has failed every scrape for `dark_after_s` or longer while
    #: the attempt's other nodes answered, and whose host answered nothing: a frozen, dead or
    #: cut-off host.
    dark_nodes: tuple[str, ...] = ()
    #: Such nodes whose host refused the connection: it is up, its training processes are
    #: gone (a crashed rank takes its node's exporter with it when its local peers fail).
    exited_nodes: tuple[str, ...] = ()
    #: Nodes failing their scrapes, not yet long enough to be known dark or exited.
    failing_nodes: tuple[str, ...] = ()
    #: How long a node must fail every scrape to count as dark (`dark_after`), and when
    #: (wall clock) the first of `failing_nodes` will have, if it goes on failing.
    dark_after_s: float = DARK_AFTER_S
    dark_settles_at: float | None = None
    #: While a node is dark or exited: seconds since the furthest step the answering nodes
    #: had begun last changed (they wait in its collective; progress clears the node).
    peers_steady_s: float | None = None

    @property
    def latest(self) -> MetricSample | None:
        return self.samples[-1] if self.samples else None


@dataclass(frozen=True)
class LossPoint:
    """One observed (step, loss), tagged with the attempt that computed it."""

    step: int
    loss: float
    attempt: int | None = None
    t: float | None = None
    source: str = "metrics"  # "metrics" or "checkpoint"


class MetricSource(Protocol):
    """What the reconciler asks each tick: views for the active (run, attempt) pairs. `probe`:
    pairs whose endpoints should be read now, not at the next scrape (a hang limit that ran
    out); a source that reads every endpoint each tick has nothing more to do for them."""

    name: str

    def collect(
        self, keys: Sequence[RunKey], now: float, probe: Collection[RunKey] = ()
    ) -> dict[RunKey, MetricsView]: ...


def dark_after(scrape_interval_s: float | None) -> float:
    """How long a node must fail every scrape before it counts as dark (pure)."""
    if not scrape_interval_s or scrape_interval_s <= 0:
        return DARK_AFTER_S
    return max(DARK_AFTER_S, DARK_AFTER_SCRAPES * scrape_interval_s)
