"""Prometheus metrics of a training process (names and labels pinned in docs/contracts.md).

One endpoint per node, served by its local rank 0 from an own `CollectorRegistry`. Every node
exports its own step progress and step time (stragglers show up per node); only global rank
0's node exports run-level values (loss, grad norm, checkpoints, …), so no series is
duplicated or stale. Trailing-window gauges (max/min loss, max grad norm, mean step time over
the last 16 steps) make a single bad step visible even when it falls between two scrapes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from contracts.metric_names import LABELS, NODE_METRICS, PREFIX, RUN_METRICS, WINDOW_STEPS


@dataclass
class StepReport:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    samples_consumed: int
    skipped: int
    step_time: float
    node_step_time: float
    mfu: float
    local_grads_finite: bool = True  # this node's own gradients, before reduction
    anomalous: bool = False  # the trainer judged the step bad (megatron_runs.anomaly)


class TrainMetrics:
    """Holds this process's series; `run_level` only on global rank 0."""

    def __init__(
        self,
        run_id: str,
        attempt: int,
        node: str,
        run_level: bool,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = CollectorRegistry()
        self._monotonic = monotonic
        self.run_level = run_level
        labels = {"run_id": run_id, "attempt": str(attempt), "node": node}
        self._m: dict[str, object] = {}
        table = {**NODE_METRICS, **(RUN_METRICS if run_level else {})}
        for name, (kind, doc) in table.items():
            cls = Counter if kind == "counter" else Gauge
            metric = cls(PREFIX + name, doc, LABELS, registry=self.registry)
            self._m[name] = metric.labels(**labels)
        self._losses: deque[float] = deque(maxlen=WINDOW_STEPS)
        self._norms: deque[float] = deque(maxlen=WINDOW_STEPS)
        self._times: deque[float] = deque(maxlen=WINDOW_STEPS)
        self._last_step_done: float | None = None
        self._gap_max = 0.0

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; return the bound port (port 0 → ephemeral)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_address[1])

    def set_up(self, up: bool) -> None:
        self._m["up"].set(1 if up else 0)

    def start(self, target_steps: int, step: int, samples_consumed: int) -> None:
        self._m["step"].set(step)
        self._m["step_entered"].set(step)
        if self.run_level:
            self._m["target_steps"].set(target_steps)
            self._m["samples_consumed"].set(samples_consumed)

    def on_step_entered(self, step: int) -> None:
        """This node began `step`. In a hang, its peers wait inside the step's collectives
        while the node that hung has not begun it: the one gauge that tells them apart."""
        self._m["step_entered"].set(step)

    def on_step(self, r: StepReport) -> None:
        m = self._m
        # The gap on the monotonic clock: a wall clock stepped by NTP would make one.
        done = self._monotonic()
        if self._last_step_done is not None:
            self._gap_max = max(self._gap_max, done - self._last_step_done)
            m["step_gap_max_seconds"].set(self._gap_max)
        self._last_step_done = done
        m["step"].set(r.step)
        m["last_step_timestamp_seconds"].set(time.time())
        m["steps"].inc()
        self._times.append(r.node_step_time)
        m["step_time_seconds"].set(r.node_step_time)
        m["step_time_window_avg_seconds"].set(sum(self._times) / len(self._times))
        if not r.local_grads_finite:
            m["nonfinite_grads"].inc()
        if not self.run_level:
            return
        finite = math.isfinite(r.loss) and math.isfinite(r.grad_norm)
        m["loss"].set(r.loss)
        m["grad_norm"].set(r.grad_norm)
        if not finite:
            m["nonfinite_steps"].inc()
        if r.anomalous:
            m["anomalous_steps"].inc()
        if math.isfinite(r.loss):
            m["loss_summed"].inc(r.loss)
        # Windows keep NaN/Inf out of max/min (a NaN poisons comparisons), but an Inf loss
        # is kept as the max so it stays visible for the whole window.
        self._losses.append(r.loss if not math.isnan(r.loss) else -math.inf)
        self._norms.append(r.grad_norm if not math.isnan(r.grad_norm) else -math.inf)
        m["loss_window_max"].set(max(self._losses))
        finite_losses = [x for x in self._losses if math.isfinite(x)]
        m["loss_window_min"].set(min(finite_losses) if finite_losses else math.nan)
        m["grad_norm_window_max"].set(max(self._norms))
        m["learning_rate"].set(r.lr)
        m["tokens"].inc(r.tokens)
        m["samples_consumed"].set(r.samples_consumed)
        if r.skipped:
            m["skipped_samples"].inc(r.skipped)
        m["tokens_per_second"].set(r.tokens / r.step_time if r.step_time > 0 else 0.0)
        m["mfu_ratio"].set(r.mfu)

    def on_resumed_eval(self, last_eval: tuple[int, float] | None) -> None:
        """The resumed checkpoint's newest evaluation: the watchdog compares this attempt's
        first evaluation with it (`eval_jump`). No evaluation yet in this attempt."""
        if not self.run_level:
            return
        self._m["eval_resumed_loss"].set(math.nan if last_eval is None else last_eval[1])
        self._m["eval_loss"].set(math.nan)
        self._m["eval_step"].set(math.nan)

    def on_eval(self, step: int, loss: float) -> None:
        if not self.run_level:
            return
        self._m["eval_loss"].set(loss)
        self._m["eval_step"].set(step)

    def on_save_wait(self, waiting: bool) -> None:
        """The loop began (or ended) waiting on a save: a synchronous one, or the wait for an
        asynchronous one in flight."""
        self._m["save_started_timestamp_seconds"].set(time.time() if waiting else 0)

    def on_checkpoint(self, step: int, duration: float, ok: bool) -> None:
        if not self.run_level:
            return
        if ok:
            self._m["checkpoint_step"].set(step)
            self._m["checkpoint_last_timestamp_seconds"].set(time.time())
            self._m["checkpoint_duration_seconds"].set(duration)
        else:
            self._m["checkpoint_failures"].inc()

    def on_replica_check(self, mismatch: bool) -> None:
        if not self.run_level:
            return
        self._m["replica_checks"].inc()
        if mismatch:
            self._m["replica_mismatches"].inc()
