"""The trainer's own judgement of each step: bad or not, which samples, which nodes (pure).

After the step's all-reduce every rank holds each sample's loss and the nodes whose gradients
went non-finite, so every rank reaches the same verdict; global rank 0 writes it down
(`contracts.anomalies`). A step is bad when
- its update was skipped or its loss is non-finite (`nonfinite`): the bad samples are those
  whose own loss is non-finite; none when only gradients were (a node's backward pass), or
- its loss is far above its recent trend (`spike`): above both `loss_spike_ratio` × the
  median of the last `loss_spike_window` good steps and that median plus
  `loss_spike_mad_factor` robust sigmas (the watchdog's sustained-spike rule, applied to every
  step instead of to what scrapes saw); the bad samples are those whose own loss is above the
  same threshold (every sample of the step when none is alone).
Only good steps feed the trend, and none is judged a spike before MIN_TREND_STEPS of them.
The first good step after bad ones is recorded too (`clean_record`): the episode is over.
The skipped-update budget (`SkipBudget`) stops a run whose trainer keeps containing faults.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from contracts.anomalies import CLEAN, NONFINITE, SPIKE, Anomaly, ranges_of
from contracts.spec import RecoverySpec

#: Good steps the trend needs before a spike can be judged against it.
MIN_TREND_STEPS = 8
#: Scale of the median absolute deviation to a normal sigma.
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class StepOutcome:
    """What every rank knows of one step after its all-reduce."""

    step: int
    loss: float
    #: The step's global sample indices, and each one's own loss (same order).
    indices: Sequence[int]
    sample_losses: Sequence[float]
    update_skipped: bool
    nonfinite_nodes: tuple[str, ...]
    next_cursor: int


class LossTrend:
    """The last `window` good steps' losses."""

    def __init__(self, window: int) -> None:
        self.losses: deque[float] = deque(maxlen=window)

    def threshold(self, rc: RecoverySpec) -> float | None:
        if len(self.losses) < MIN_TREND_STEPS:
            return None
        med = statistics.median(self.losses)
        mad = statistics.median(abs(x - med) for x in self.losses)
        return max(rc.loss_spike_ratio * med, med + rc.loss_spike_mad_factor * MAD_TO_SIGMA * mad)

    def add(self, loss: float) -> None:
        self.losses.append(loss)


def judge(
    out: StepOutcome, trend: LossTrend, rc: RecoverySpec, attempt: int, now: float
) -> Anomaly | None:
    """The step's record if it was bad (the trend learns only from good steps)."""
    consumed = (min(out.indices, default=0), max(out.indices, default=-1) + 1)
    if out.update_skipped or not math.isfinite(out.loss):
        pairs = zip(out.indices, out.sample_losses, strict=True)
        bad = [g for g, x in pairs if not math.isfinite(x)]
        return Anomaly(
            attempt=attempt,
            step=out.step,
            kind=NONFINITE,
            samples=ranges_of(bad),
            nodes=out.nonfinite_nodes,
            consumed=consumed,
            update_skipped=out.update_skipped,
            loss=out.loss,
            t=now,
        )
    thr = trend.threshold(rc)
    if thr is not None and out.loss > thr:
        high = [g for g, x in zip(out.indices, out.sample_losses, strict=True) if x > thr]
        return Anomaly(
            attempt=attempt,
            step=out.step,
            kind=SPIKE,
            samples=ranges_of(high or out.indices),
            consumed=consumed,
            loss=out.loss,
            threshold=thr,
            t=now,
        )
    trend.add(out.loss)
    return None


def clean_record(out: StepOutcome, attempt: int, now: float) -> Anomaly:
    """The `clean` line of a good step that follows bad ones: their episode is over."""
    return Anomaly(
        attempt=attempt,
        step=out.step,
        kind=CLEAN,
        consumed=(min(out.indices, default=0), max(out.indices, default=-1) + 1),
        loss=out.loss,
        t=now,
    )


class SkipBudget:
    """Steps whose update was skipped, within the trailing `window` steps."""

    def __init__(self, budget: int, window: int) -> None:
        self.budget = budget
        self.window = window
        self.steps: deque[int] = deque()

    def add(self, step: int) -> bool:
        """Count a skipped update; True when the budget is now exceeded."""
        self.steps.append(step)
        while self.steps and self.steps[0] <= step - self.window:
            self.steps.popleft()
        return len(self.steps) > self.budget
