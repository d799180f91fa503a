"""The training loop: `set_up`, then `for step: train_step → report → maybe_checkpoint`.

Every rank runs this (imported lazily by `train`). One small all-reduce per step carries the
loss (from the last pipeline stage) and the stop request (USR2/TERM seen by any rank), so all
ranks agree on what happened and stop at the same step boundary (after training through the
signal while the next attempt's job gets ready, `megatron_runs.handover`). Faults are injected only
through `Trainer.faults`, at the fixed points named in `megatron_runs.faults`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_runs import cpu_compat

CPU = cpu_compat.apply()

import torch  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

from contracts import anomalies, exitcodes  # noqa: E402
from contracts.spec import RunSpec  # noqa: E402
from contracts.task import TrainContext  # noqa: E402
from megatron_runs import handover, replicas  # noqa: E402
from megatron_runs.anomaly import (  # noqa: E402
    LossTrend,
    SkipBudget,
    StepOutcome,
    StragglerWatch,
    clean_record,
    judge,
    node_busy,
    straggler_record,
)
from megatron_runs.data import MicroBatch, build_microbatches, to_device  # noqa: E402
from megatron_runs.metrics import StepReport  # noqa: E402
from megatron_runs.sampling import rank_slice, take_step  # noqa: E402
from megatron_runs.saver import Checkpointer  # noqa: E402
from megatron_runs.schedule import flops_per_token, lr_at, peak_flops  # noqa: E402
from megatron_runs.setup import SetupClock, StopFlag, Trainer, set_up  # noqa: E402
from megatron_runs.train import TrainResult  # noqa: E402

#: The step's all-reduced stats: loss sum, microbatch count, stop signal, the save interval
#: rank 0 proposes (0: none), whether rank 0 says leave now (after a stop signal); then one
#: slot per node of the job, set where a device of that node made non-finite gradients; then
#: one slot per sample of the global batch, its own loss (`megatron_runs.anomaly` judges them).
STATS_FIXED = 5


@dataclass(frozen=True)
class _Plan:
    """What every step of this attempt shares: the schedule and the throughput constants."""

    fwd_bwd: Callable
    num_micro: int
    #: Whether this rank reports the loss: the last pipeline stage's tensor rank 0.
    loss_reporter: bool
    tokens_per_step: int
    flops_step: float
    peak: float


@dataclass(frozen=True)
class _Step:
    """One finished step, as every rank agrees on it after the stats all-reduce."""

    step: int
    cursor: int
    skipped: int
    loss: float
    grad_norm: float
    lr: float
    ok: bool
    #: The stop signal any rank saw (0: none).
    signum: int
    #: The save interval rank 0 proposed at this step (0: none).
    interval: int
    #: Whether and how rank 0 said leave at this step (a `handover` code: a stop signal came
    #: earlier and its handover is due).
    leave: int
    #: Per node of the job: nonzero where a device of that node made non-finite gradients.
    made_nan: list[float]
    #: Per global rank: its busy time this step (before the all-reduce).
    rank_busy: list[float]
    #: The step's global sample indices and each one's own loss.
    indices: tuple[int, ...]
    sample_losses: list[float]
    busy: float
    wall: float


def run(spec: RunSpec, ctx: TrainContext) -> TrainResult:
    """Train this rank on from the checkpoint set-up loaded (or from scratch) to `train_steps`
    or `ctx.stop_at_step` (exit 0), or to the step boundary after a stop signal (exit 75)."""
    entered = time.time()
    stop = StopFlag()
    stop.install()
    clock = SetupClock()
    tr = set_up(spec, ctx, clock)
    t = spec.training
    tokens_per_step = t.global_batch_size * spec.model.seq_length
    plan = _Plan(
        fwd_bwd=get_forward_backward_func(),
        num_micro=t.global_batch_size // (t.micro_batch_size * tr.dp_size),
        loss_reporter=ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0,
        tokens_per_step=tokens_per_step,
        flops_step=flops_per_token(spec) * tokens_per_step,
        peak=peak_flops(tr.device) * tr.world,
    )
    losses: list[float] = []
    exit_code = exitcodes.OK
    target = t.train_steps if ctx.stop_at_step is None else min(t.train_steps, ctx.stop_at_step)
    checkpoints = Checkpointer(
        spec.checkpoint, tr.root, tr.layout, tr.resumed_from, tr.metrics, tr.faults, tr.log,
        ctx.mtbf_seconds, tr.memory_tier,
    )  # fmt: skip
    trend = LossTrend(spec.recovery.loss_spike_window)
    for x in tr.loss_trend:
        trend.add(x)
    budget = SkipBudget(
        spec.recovery.skipped_updates_budget, spec.recovery.skipped_updates_window_steps
    )
    stragglers = StragglerWatch(spec.recovery.straggler_ratio, spec.recovery.straggler_steps)
    clock.mark("other")
    tr.log(
        "train_start", step=tr.step, cursor=tr.cursor, target=target, layout=tr.layout, cpu=CPU,
        features=tr.features, nodes=tr.nodes, entered=round(entered, 3),
        setup_seconds=clock.seconds,
    )  # fmt: skip

    bad: anomalies.Anomaly | None = None
    watch = handover.Handover(ctx.handover_ready)
    signalled = 0  # the stop signal the ranks agreed on so far (TERM outranks USR2)
    step_s = 0.0
    while tr.step < target:
        leave = handover.GO_ON
        if tr.rank == 0 and watch.due(time.monotonic()):
            since = tr.step + 1 - checkpoints.newest_step
            leave = handover.leave_code(since, step_s, checkpoints.last_seconds)
        done = _train_step(spec, ctx, tr, plan, stop, checkpoints.proposed, leave)
        step_s = done.wall
        checkpoints.proposed = 0  # carried to every rank by this step's all-reduce
        tr.step, tr.cursor = done.step, done.cursor
        losses.append(done.loss)
        bad = _judge(spec, ctx, tr, done, trend, after_bad=bad is not None)
        _judge_nodes(ctx, tr, done, stragglers)
        _report(spec, tr, plan, done, bad is not None)
        if bad is not None and bad.update_skipped and budget.add(done.step):
            _stop_on_budget(ctx, tr, budget, bad)
            exit_code = exitcodes.SKIP_BUDGET
            break
        check_every = t.replica_check_every
        if check_every and done.step % check_every == 0:
            _check_replicas(tr, done.step)
        checkpoints.poll()
        if done.interval and done.interval != checkpoints.interval:
            tr.log(
                "checkpoint_interval", step=done.step, interval_steps=done.interval,
                was=checkpoints.interval, mtbf_seconds=round(checkpoints.mtbf_seconds),
            )  # fmt: skip
            checkpoints.interval = done.interval
        new_signal = done.signum if done.signum > signalled else 0
        signalled = max(signalled, done.signum)
        leaving = done.leave != handover.GO_ON
        if new_signal:
            allowed = handover.allowed_seconds(
                new_signal, ctx.signal_lead_s, spec.recovery.preemption_grace_seconds
            )
            if handover.train_on_seconds(allowed, 0.0, 0.0) <= 0:
                leaving = True  # the same on every rank: the signal, the lead and the grace
            elif tr.rank == 0:
                save_s = checkpoints.last_seconds
                watch.begin(time.monotonic(), handover.train_on_seconds(allowed, save_s, done.wall))
        leaving = leaving and done.step < target  # a signal at the last step: no matter
        if new_signal and done.step < target:
            _announce_stop(ctx, tr, done, leaving)
        # Not after a stop signal: its lead time is the checkpoints' (the curve misses points).
        if t.eval_interval and done.step % t.eval_interval == 0 and not signalled:
            tr.last_eval = (done.step, _evaluate(spec, tr, plan, done.step))
        saves = done.step % checkpoints.interval == 0 or done.step >= target
        if saves or (leaving and done.leave != handover.LEAVE_UNSAVED):
            finish_param_gather(tr.model)
            checkpoints.save(
                tr.model, tr.optimizer, tr.step, tr.cursor, done.loss, tuple(trend.losses),
                done.wall, tr.last_eval,
            )  # fmt: skip
        if leaving:
            if done.leave != handover.GO_ON:
                resume = checkpoints.newest_step
                tr.log("handover", step=done.step, resume_step=resume, saved=resume == done.step)
            exit_code = exitcodes.REQUEUE
            break

    checkpoints.finish()
    if tr.metrics is not None:
        tr.metrics.set_up(False)
    last_loss = losses[-1] if losses else math.nan
    tr.log("train_end", step=tr.step, loss=last_loss, exit_code=exit_code)
    return TrainResult(
        exit_code=exit_code, final_step=tr.step, consumed_samples=tr.cursor, losses=losses
    )


def _train_step(
    spec: RunSpec,
    ctx: TrainContext,
    tr: Trainer,
    plan: _Plan,
    stop: StopFlag,
    proposed: int,
    leave: int,
) -> _Step:
    """Forward, backward and optimizer step of step `tr.step + 1` on this rank's share of the
    global batch, then the one all-reduce of its loss, stop signal, the save interval rank 0
    proposes (`proposed`, 0 elsewhere), whether and how rank 0 says leave (`leave`, a
    `handover` code), non-finite flags and each sample's loss."""
    step_start = time.perf_counter()
    step = tr.step + 1
    t = spec.training
    tr.faults.before_step(step)
    if tr.metrics is not None:
        tr.metrics.on_step_entered(step)
    # First, so that the GPU clears the grad buffers while the host assembles the batch.
    for chunk in tr.model:
        chunk.zero_grad_buffer()
    tr.optimizer.zero_grad()
    lr = lr_at(step, t)
    _set_lr(tr.optimizer, lr)
    taken = take_step(tr.cursor, t.global_batch_size, ctx.skip_ranges)
    mine = rank_slice(taken.indices, tr.dp_rank, tr.dp_size)
    batches = build_microbatches(
        tr.source, mine, t.micro_batch_size, t.seed, spec.model.vocab_size, tr.faults.poison_effect
    )
    out = _run_schedule(spec, tr, plan, batches, forward_only=False)
    ok, grad_norm, _ = tr.optimizer.step()
    busy = time.perf_counter() - step_start
    busy += tr.faults.straggle(step, busy)
    # Loss sum, microbatch count, stop signal, the nodes that made non-finite grads and each
    # rank's busy time: one all-reduce and one host sync per step.
    reported = float(len(out)) if plan.loss_reporter else 0.0
    nodes, ranks = len(tr.nodes), tr.world
    stats = torch.tensor(
        [
            0.0,
            reported,
            handover.signal_code(stop.signum, tr.world),
            float(proposed if tr.rank == 0 else 0),
            float(leave),
        ]
        + [0.0] * (nodes + ranks),
        dtype=torch.float64,
        device=tr.device,
    )
    if plan.loss_reporter and out:
        stats[0] = torch.stack([d["lm loss"] for d in out]).double().sum()
    if tr.local_grads[0] is not None:
        stats[STATS_FIXED + tr.node_index] = (~tr.local_grads[0]).double()
    stats[STATS_FIXED + nodes + tr.rank] = busy
    per_sample = torch.zeros(len(taken.indices), dtype=torch.float64, device=tr.device)
    if plan.loss_reporter and out:
        place = {g: i for i, g in enumerate(taken.indices)}
        where = torch.tensor([place[g] for d in out for g in d["indices"]], device=tr.device)
        per_sample[where] = torch.cat([d["sample_losses"] for d in out]).double()
    stats = torch.cat([stats, per_sample])
    torch.distributed.all_reduce(stats)
    values = stats.tolist()
    loss_sum, count, signals, interval, leaving = values[:STATS_FIXED]
    made_nan = values[STATS_FIXED : STATS_FIXED + nodes]
    per_rank_end = STATS_FIXED + nodes + ranks
    return _Step(
        step=step,
        cursor=taken.next_cursor,
        skipped=taken.skipped,
        loss=loss_sum / count if count > 0 else math.nan,
        grad_norm=float(grad_norm) if ok and grad_norm is not None else math.nan,
        lr=lr,
        ok=ok,
        signum=handover.signal_seen(signals, tr.world),
        interval=int(interval),
        leave=int(leaving),
        made_nan=made_nan,
        rank_busy=values[STATS_FIXED + nodes : per_rank_end],
        indices=taken.indices,
        sample_losses=values[per_rank_end:],
        busy=busy,
        wall=time.perf_counter() - step_start,
    )


def _evaluate(spec: RunSpec, tr: Trainer, plan: _Plan, step: int) -> float:
    """The validation loss: the mean microbatch loss over the first `eval_iters` global
    batches of the valid split (the same samples every time), forward only, averaged over the
    data-parallel ranks by one all-reduce. Consumes no training sample and changes no state
    training reads (no update, no RNG: dropout is off in eval mode), so the training losses
    are those of a run without evaluations. Logged as an `eval` line on every rank and
    exported as `nightwatch_train_eval_loss`."""
    t = spec.training
    assert tr.valid is not None  # the spec's validator: eval_interval needs a valid split
    t0 = time.perf_counter()
    # As Megatron-LM's train loop around evaluate: the overlapped param all-gather's hooks off
    # (finishing the gather) for the forward-only passes, back on for the next step. GPU only
    # (distributed optimizer, DP > 1); the CPU tests do not reach it.
    overlapped = [c for c in tr.model if getattr(c, "use_forward_hook", False)]
    for chunk in overlapped:
        chunk.disable_forward_pre_hook(param_sync=True)
    for chunk in tr.model:
        chunk.eval()
    total = torch.zeros(2, dtype=torch.float64, device=tr.device)
    with torch.no_grad():
        for k in range(t.eval_iters):
            indices = range(k * t.global_batch_size, (k + 1) * t.global_batch_size)
            mine = rank_slice(indices, tr.dp_rank, tr.dp_size)
            batches = build_microbatches(
                tr.valid, mine, t.micro_batch_size, t.seed, spec.model.vocab_size
            )
            out = _run_schedule(spec, tr, plan, batches, forward_only=True)
            if plan.loss_reporter and out:
                total[0] += torch.stack([d["lm loss"] for d in out]).double().sum()
                total[1] += len(out)
    for chunk in tr.model:
        chunk.train()
    for chunk in overlapped:
        chunk.enable_forward_pre_hook()
    torch.distributed.all_reduce(total)
    loss_sum, count = total.tolist()
    loss = loss_sum / count if count > 0 else math.nan
    if tr.metrics is not None:
        tr.metrics.on_eval(step, loss)
    tr.log(
        "eval", all_ranks=True, step=step, loss=loss, iters=t.eval_iters,
        samples=t.eval_iters * t.global_batch_size, seconds=round(time.perf_counter() - t0, 4),
    )  # fmt: skip
    return loss


def _run_schedule(
    spec: RunSpec, tr: Trainer, plan: _Plan, batches: list, *, forward_only: bool
) -> list:
    """One global batch's microbatches through the pipeline schedule (forward and backward,
    or forward only to evaluate); the last stage's per-microbatch loss records."""
    # The interleaved schedule reads each model chunk's microbatches from its own iterator.
    chunks = [to_device(batches, tr.device) for _ in tr.model]
    return plan.fwd_bwd(
        forward_step_func=forward_step,
        data_iterator=chunks if len(chunks) > 1 else chunks[0],
        model=tr.model,
        num_microbatches=plan.num_micro,
        seq_length=spec.model.seq_length,
        micro_batch_size=spec.training.micro_batch_size,
        decoder_seq_length=spec.model.seq_length,
        forward_only=forward_only,
    )


def _judge(
    spec: RunSpec, ctx: TrainContext, tr: Trainer, done: _Step, trend: LossTrend, after_bad: bool
) -> anomalies.Anomaly | None:
    """The step's verdict (the same on every rank); global rank 0 records a bad one before
    the step's metrics move, so a scrape that counts it finds its record, and a good one
    `after_bad` as the `clean` line that ends the episode."""
    outcome = StepOutcome(
        step=done.step,
        loss=done.loss,
        indices=done.indices,
        sample_losses=done.sample_losses,
        update_skipped=not done.ok,
        nonfinite_nodes=tuple(n for n, bad in zip(tr.nodes, done.made_nan, strict=True) if bad),
        next_cursor=done.cursor,
    )
    bad = judge(outcome, trend, spec.recovery, ctx.attempt, time.time())
    if tr.rank == 0:
        if bad is not None:
            anomalies.append(tr.root, bad)
        elif after_bad:
            anomalies.append(tr.root, clean_record(outcome, ctx.attempt, time.time()))
    return bad


def _judge_nodes(ctx: TrainContext, tr: Trainer, done: _Step, watch: StragglerWatch) -> None:
    """Name a node that keeps stepping slower than the others (the same on every rank);
    global rank 0 records it, so the watchdog moves off it without waiting for scrapes."""
    named = watch.observe(node_busy(done.rank_busy, tr.rank_nodes, tr.nodes))
    for node, (ratio, steps) in named.items():
        record = straggler_record(done.step, node, ratio, steps, ctx.attempt, time.time())
        if tr.rank == 0:
            anomalies.append(tr.root, record)
        tr.log("straggler", step=done.step, node=node, ratio=round(ratio, 3),
               window_steps=steps)  # fmt: skip


def _announce_stop(ctx: TrainContext, tr: Trainer, done: _Step, leaving: bool) -> None:
    """Record that the ranks stop on a signal, now (`leaving`: before the save they leave on)
    or after training through it: the supervisor reads the line at once and prepares the next
    job while the save runs, or while they train on."""
    if tr.rank == 0:
        record = anomalies.Anomaly(
            attempt=ctx.attempt, step=done.step, kind=anomalies.STOP_SIGNAL, t=time.time()
        )
        anomalies.append(tr.root, record)
    tr.log("stopping_on_signal", step=done.step, signal=done.signum, at_once=leaving)


def _stop_on_budget(
    ctx: TrainContext, tr: Trainer, budget: SkipBudget, last: anomalies.Anomaly
) -> None:
    """Record and log why the trainer stops: more skipped updates than the budget allows."""
    stop = anomalies.Anomaly(
        attempt=ctx.attempt,
        step=last.step,
        kind=anomalies.STOP,
        samples=last.samples,
        nodes=last.nodes,
        consumed=last.consumed,
        update_skipped=True,
        t=time.time(),
        skipped_updates=len(budget.steps),
        window_steps=budget.window,
    )
    if tr.rank == 0:
        anomalies.append(tr.root, stop)
    tr.log(
        "skip_budget_exceeded", step=last.step, skipped_updates=list(budget.steps),
        budget=budget.budget, window_steps=budget.window, samples=[list(r) for r in last.samples],
        nodes=list(last.nodes), exit_code=exitcodes.SKIP_BUDGET,
    )  # fmt: skip


def _report(spec: RunSpec, tr: Trainer, plan: _Plan, done: _Step, bad: bool) -> None:
    """The step into this node's metrics, and a `step` log line every `log_interval` steps
    and on every skipped update."""
    if tr.metrics is not None:
        tr.metrics.on_step(
            StepReport(
                step=done.step,
                loss=done.loss,
                grad_norm=done.grad_norm,
                lr=done.lr,
                tokens=plan.tokens_per_step,
                samples_consumed=done.cursor,
                skipped=done.skipped,
                step_time=done.wall,
                node_step_time=done.busy,
                mfu=plan.flops_step / (done.wall * plan.peak) if plan.peak else 0.0,
                local_grads_finite=done.made_nan[tr.node_index] == 0,
                anomalous=bad,
            )
        )
    if done.step % spec.training.log_interval == 0 or not done.ok:
        tr.log(
            "step",
            step=done.step,
            loss=done.loss,
            grad_norm=done.grad_norm,
            lr=done.lr,
            skipped_update=not done.ok,
            nonfinite_nodes=[n for n, bad in zip(tr.nodes, done.made_nan, strict=True) if bad],
            step_time=round(done.wall, 4),
            consumed=done.cursor,
        )


def _check_replicas(tr: Trainer, step: int) -> None:
    """Compare the replicas' parameter checksums (`replicas.check`); log and count the result."""
    finish_param_gather(tr.model)
    mismatch = replicas.check(tr.model, tr.device)
    if tr.metrics is not None:
        tr.metrics.on_replica_check(mismatch)
    tr.log("replica_mismatch" if mismatch else "replica_check", step=step)


def _set_lr(optimizer: object, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def finish_param_gather(model: list) -> None:
    """With `overlap_param_gather` the optimizer step updates only this rank's shard; the other
    shards arrive during the next forward pass. Gather them now, before a checksum or a
    checkpoint reads the weights (what Megatron-LM does before saving). No-op otherwise."""
    with torch.no_grad():
        for chunk in model:
            if chunk.ddp_config.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)


def forward_step(data_iterator: object, model: object) -> tuple[torch.Tensor, Callable]:
    """One microbatch: per-token losses out, a loss function that weights them."""
    b: MicroBatch = next(data_iterator)
    per_token = model(b.tokens, b.position_ids, None, labels=b.labels)

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        weighted = output.float().reshape(-1) * b.loss_mask.reshape(-1)
        loss = weighted.sum() / b.loss_mask.numel()
        # Each sample's own loss, for the step's verdict (megatron_runs.anomaly).
        rows = weighted.detach().reshape(len(b.indices), -1)
        # The schedule divides the returned loss in place: report a detached copy.
        return loss, {
            "lm loss": loss.detach().clone(),
            "sample_losses": rows.sum(dim=1) / rows.shape[1],
            "indices": b.indices,
        }

    return per_token, loss_func
