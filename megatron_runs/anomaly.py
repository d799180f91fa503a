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
A node that keeps stepping slower than the others is named too (`StragglerWatch`): the step's
all-reduce carries every rank's busy time, so every rank knows each node's, every step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from contracts.anomalies import CLEAN, NONFINITE, SPIKE, STRAGGLER, Anomaly, ranges_of
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


def node_busy(
    rank_busy: Sequence[float], rank_nodes: Sequence[int], nodes: Sequence[str]
) -> dict[str, float]:
    """Each node's step time: its slowest rank's busy time (the others wait for that rank in
    the step's all-reduce)."""
    out: dict[str, float] = {}
    for busy, index in zip(rank_busy, rank_nodes, strict=True):
        node = nodes[index]
        out[node] = max(out.get(node, 0.0), busy)
    return out


#: A node whose steps take this many times the others' (or `straggler_ratio` × if more) costs
#: the job more than a healthy step at each step: it is named after `severe_steps(steps)` such
#: steps in a row instead of a majority of the window.
SEVERE_RATIO = 2.0


def severe_steps(steps: int) -> int:
    """How many steps in a row a severe straggler is slow for before it is named: a third of
    the window (5 of 16), at least 4. A healthy node's stalls rarely come in such runs: one step
    in 20 stalled 1-5× makes five in a row above 2× about once in 10^7 steps."""
    return max(4, steps // 3)


class StragglerWatch:
    """Each node's step time over the median of the other nodes', for the last `steps` steps.

    A node is named once it was slower than `ratio` × the others in more than half of its
    last `steps` steps: neither a few noisy steps of a healthy node nor a few normal ones of a
    slow node decide. A node slower than `SEVERE_RATIO` × the others in each of its last
    `severe_steps(steps)` steps is named then: waiting for the majority would cost more than
    a healthy step's time at each step. Named once per episode, which ends once it was slow in
    at most half of the window and in none of its last `severe_steps(steps)`. Needs two nodes
    (one node has nobody to be slower than)."""

    def __init__(self, ratio: float, steps: int) -> None:
        self.ratio = ratio
        self.steps = steps
        self.severe = severe_steps(steps)
        self.severe_ratio = max(SEVERE_RATIO, ratio)
        self.ratios: dict[str, deque[float]] = {}
        self.named: set[str] = set()

    def observe(self, busy: Mapping[str, float]) -> dict[str, tuple[float, int]]:
        """Add one step's node times; the nodes named at this step, each with the median of
        its slow steps' ratios and the steps it was judged over."""
        if len(busy) < 2:
            return {}
        out = {}
        for node, t in busy.items():
            ref = statistics.median(v for n, v in busy.items() if n != node)
            window = self.ratios.setdefault(node, deque(maxlen=self.steps))
            window.append(t / ref if ref > 0 else 1.0)
            slow = [r for r in window if r > self.ratio]
            recent = list(window)[-self.severe :]
            majority = 2 * len(slow) > self.steps
            severe = len(recent) == self.severe and min(recent) > self.severe_ratio
            if majority or severe:
                if node not in self.named:
                    self.named.add(node)
                    ratios, steps = (slow, self.steps) if majority else (recent, self.severe)
                    out[node] = (statistics.median(ratios), steps)
            elif max(recent) <= self.ratio:
                self.named.discard(node)  # the episode is over
        return out


def straggler_record(
    step: int, node: str, ratio: float, steps: int, attempt: int, now: float
) -> Anomaly:
    """The `straggler` line naming `node` at `step` (judged over the `steps` steps to it)."""
    return Anomaly(
        attempt=attempt, step=step, kind=STRAGGLER, nodes=(node,), ratio=ratio,
        window_steps=steps, t=now,
    )  # fmt: skip
