"""Realistic synthetic training telemetry, as the worker's gauges would expose it.

A run is simulated step by step (decaying loss + heavy-tailed noise, grad norm, tokens/s,
per-node step time), then observed every `steps_per_sample` steps the way a scrape would see
it: last values, 16-step window max/min, counters. Faults are applied to the per-step values,
so detectors see them only through what the contract's metrics would show.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from contracts.metric_names import WINDOW_STEPS
from supervisor.metrics_in import MetricSample, MetricsView, SourceHealth
from supervisor.models import AttemptState
from supervisor.watchdog.snapshot import JobView, Snapshot

GLOBAL_BATCH = 8


@dataclass
class Faults:
    spike_steps: tuple[int, int] | None = None  # loss × spike_factor on [a, b)
    spike_factor: float = 6.0
    nan_from: int | None = None
    nan_grads_only: bool = False  # a node's backward pass: the loss stays finite
    grad_from: int | None = None
    grad_value: float = 40.0
    slow_from: int | None = None  # tokens/s × 0.3 from this step
    straggler: str | None = None  # this node's step time × 2
    hang_at: int | None = None  # no step finishes after this one
    mismatch_from: int | None = None
    checkpoint_every: int = 100
    checkpoints_stop_at: int | None = None
    checkpoint_failures: int = 0
    nodes: tuple[str, ...] = ("n1", "n2", "n3")
    extra: dict[str, float] = field(default_factory=dict)


def simulate(
    seed: int,
    steps: int = 600,
    steps_per_sample: int = 2,
    faults: Faults | None = None,
    step_seconds: float = 0.5,
    start: float = 1_000_000.0,
) -> list[MetricSample]:
    """Per-scrape samples of a simulated run (oldest first)."""
    f = faults or Faults()
    rng = random.Random(seed)
    floor = rng.uniform(1.8, 3.0)
    amp = rng.uniform(4.0, 8.0)
    tau = rng.uniform(100, 400)
    noise = rng.uniform(0.01, 0.04)
    losses: list[float] = []
    grads: list[float] = []
    samples: list[MetricSample] = []
    loss_sum = nonfinite = mismatches = 0.0
    t = start
    last_step_ts = start
    ckpt_step = 0
    ckpt_ts = start
    for step in range(1, steps + 1):
        if f.hang_at is not None and step > f.hang_at:
            t += step_seconds
        else:
            base = floor + amp * math.exp(-step / tau)
            # Student-t(4)-like heavy tails: a few big but healthy wiggles.
            z = rng.gauss(0, 1) / math.sqrt(max(rng.gammavariate(2, 0.5), 1e-3))
            loss = base * (1 + noise * max(min(z, 6), -6))
            grad = rng.lognormvariate(0, 0.3)
            if f.spike_steps and f.spike_steps[0] <= step < f.spike_steps[1]:
                loss *= f.spike_factor
                grad *= 3
            if f.grad_from is not None and step >= f.grad_from:
                grad = f.grad_value * rng.uniform(0.9, 1.1)
            if f.nan_from is not None and step >= f.nan_from:
                grad = float("nan")
                loss = loss if f.nan_grads_only else grad
                nonfinite += 1
            if f.mismatch_from is not None and step >= f.mismatch_from:
                mismatches += 1
            losses.append(loss)
            grads.append(grad)
            if math.isfinite(loss):
                loss_sum += loss
            t += step_seconds * rng.uniform(0.9, 1.1)
            last_step_ts = t
            if step % f.checkpoint_every == 0 and (
                f.checkpoints_stop_at is None or step < f.checkpoints_stop_at
            ):
                ckpt_step, ckpt_ts = step, t
        done = len(losses)
        if step % steps_per_sample:
            continue
        win = losses[-WINDOW_STEPS:]
        gwin = grads[-WINDOW_STEPS:]
        slow = f.slow_from is not None and done >= f.slow_from
        tps = GLOBAL_BATCH * 128 / step_seconds * rng.uniform(0.95, 1.05) * (0.3 if slow else 1)
        step_time = {
            n: step_seconds * rng.uniform(0.95, 1.05) * (2.0 if n == f.straggler else 1.0)
            for n in f.nodes
        }
        samples.append(
            MetricSample(
                t=t,
                step=done,
                loss=losses[-1],
                loss_window_max=max(win),
                loss_window_min=min(win),
                loss_sum=loss_sum,
                steps_total=float(done),
                grad_norm=grads[-1],
                grad_norm_window_max=max(gwin),
                nonfinite_total=nonfinite,
                tokens_total=float(done * GLOBAL_BATCH * 128),
                tokens_per_second=tps,
                samples_consumed=done * GLOBAL_BATCH,
                last_step_ts=last_step_ts,
                target_steps=steps,
                checkpoint_step=ckpt_step,
                checkpoint_ts=ckpt_ts,
                checkpoint_failures_total=float(f.checkpoint_failures),
                replica_checks_total=float(done),
                replica_mismatches_total=mismatches,
                up=1.0,
                step_time=step_time,
            )
        )
    return samples


def snapshot(
    samples: list[MetricSample],
    *,
    now: float | None = None,
    health: SourceHealth = SourceHealth.UP,
    job_state: AttemptState | None = AttemptState.RUNNING,
    job_health: SourceHealth = SourceHealth.UP,
    nodes: tuple[str, ...] = ("n1", "n2", "n3"),
    exit_code: int | None = None,
    reason: str | None = None,
    failed_nodes: tuple[str, ...] = (),
    disk_checkpoint_step: int | None = None,
    target_steps: int | None = None,
    run_id: str = "r1",
    attempt: int = 1,
    prior: list[MetricSample] | None = None,
    nonfinite_grad_nodes: tuple[str, ...] = (),
    lagging_nodes: tuple[str, ...] = (),
    dark_nodes: tuple[str, ...] = (),
    exited_nodes: tuple[str, ...] = (),
    failing_nodes: tuple[str, ...] = (),
    peers_steady_s: float | None = None,
) -> Snapshot:
    last_t = samples[-1].t if samples else 1_000_000.0
    return Snapshot(
        run_id=run_id,
        attempt=attempt,
        now=last_t + 0.5 if now is None else now,
        metrics=MetricsView(
            health=health,
            samples=tuple(samples),
            prior=tuple(prior or ()),
            nonfinite_grad_nodes=nonfinite_grad_nodes,
            lagging_nodes=lagging_nodes,
            dark_nodes=dark_nodes,
            exited_nodes=exited_nodes,
            failing_nodes=failing_nodes,
            peers_steady_s=peers_steady_s,
        ),
        job=JobView(
            health=job_health,
            state=job_state,
            job_id="42",
            nodes=nodes,
            exit_code=exit_code,
            reason=reason,
            failed_nodes=failed_nodes,
        ),
        checkpoint_interval_steps=100,
        global_batch_size=GLOBAL_BATCH,
        target_steps=target_steps,
        disk_checkpoint_step=disk_checkpoint_step,
    )
