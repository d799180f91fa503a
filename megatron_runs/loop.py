"""The training loop proper: setup, step, checkpoint, signals (imported lazily by `train`).

Every rank runs this. One small all-reduce per step carries the loss (from the last pipeline
stage) and the stop request (USR2/TERM seen by any rank), so all ranks agree on what happened
and stop at the same step boundary.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from megatron_runs import cpu_compat

CPU = cpu_compat.apply()

import torch  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import (  # noqa: E402
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

from contracts import checkpoints as ck  # noqa: E402
from contracts import exitcodes  # noqa: E402
from contracts.spec import RunSpec  # noqa: E402
from contracts.task import TrainContext, nightwatch_home  # noqa: E402
from megatron_runs import dist_ckpt, replicas  # noqa: E402
from megatron_runs.data import MicroBatch, TokenStream, build_microbatches, to_device  # noqa: E402
from megatron_runs.data_prep import prepare  # noqa: E402
from megatron_runs.faults import Faults  # noqa: E402
from megatron_runs.metrics import StepReport, TrainMetrics  # noqa: E402
from megatron_runs.model import build_gpt, init_layout_independent, transformer_config  # noqa: E402
from megatron_runs.sampling import rank_slice, take_step  # noqa: E402
from megatron_runs.saver import Checkpointer  # noqa: E402
from megatron_runs.schedule import flops_per_token, lr_at, peak_flops  # noqa: E402
from megatron_runs.train import TrainResult  # noqa: E402

#: The step's all-reduced stats: loss sum, microbatch count, stop signal; then one slot per
#: node of the job, set where a device of that node made non-finite gradients.
STATS_FIXED = 3


def _replica_check_every() -> int:
    """Steps between replica checksums (NIGHTWATCH_REPLICA_CHECK_EVERY; 0 turns them off)."""
    return int(os.environ.get("NIGHTWATCH_REPLICA_CHECK_EVERY", "10"))


class _Log:
    """JSON-lines log on stderr, with run_id / attempt / job_id on every line."""

    def __init__(self, ctx: TrainContext, rank: int) -> None:
        self.base = {
            "run_id": ctx.run_id,
            "attempt": ctx.attempt,
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "node": ctx.node,
            "rank": rank,
        }
        self.rank = rank

    def __call__(self, event: str, all_ranks: bool = False, **fields: object) -> None:
        if self.rank == 0 or all_ranks:
            line = {"ts": round(time.time(), 3), "event": event, **self.base, **fields}
            # One write per line: a node task's forked ranks share its log file, and print()
            # writes the newline apart, where another rank's output could land in between.
            sys.stderr.write(json.dumps(line, default=str) + "\n")
            sys.stderr.flush()


class _SetupClock:
    """Where an attempt's start-up goes (seconds per phase, in the train_start line): a
    restart's cost is read from these, not guessed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - self._last, 3)
        self._last = now


class _StopFlag:
    """Set by USR2/TERM; acted on at the next step boundary.

    Installed first thing in `run`, so a preemption during setup or checkpoint loading (seconds)
    still ends in a checkpoint and exit 75 instead of TERM's default kill. A handler installed
    before it that remembered a signal (worker.task's `_EarlyStop`, which covers the import of
    this module) hands that signal over instead of losing it.
    """

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> None:
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            previous = signal.signal(sig, self._handler)
            self.signum = self.signum or getattr(previous, "signum", None) or 0

    def _handler(self, signum: int, _frame: object) -> None:
        self.signum = signum


def _init_distributed() -> tuple[int, int, int, torch.device]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if CPU:
        device = torch.device("cpu")
        backend = "gloo"
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend, rank=rank, world_size=world, device_id=None if CPU else device
        )
    return rank, world, local_rank, device


def _job_nodes(node: str) -> list[str]:
    """Every node of this process group, in rank order without repeats: the log then says
    where each attempt ran (a sick node's fault strikes only where a job lands on it)."""
    names: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, node)
    return list(dict.fromkeys(n for n in names if n is not None))


def _data_prefix(spec: RunSpec) -> str:
    if spec.data.prefix:
        return spec.data.prefix
    return prepare(None, nightwatch_home() / "data", spec.model.vocab_size).prefix


def _build_model(
    spec: RunSpec,
    bf16: bool,
    fused: bool = True,
    overlap_param_gather: bool = True,
    gemm_bias: bool = True,
) -> tuple[list, object]:
    """The DDP-wrapped model. On GPU by default: fused bias-dropout-add and cross-entropy (bf16
    only, see `transformer_config`), QKV and fc1 biases added inside their GEMMs
    (`model.GemmBiasColumnParallelLinear`) and, with the distributed optimizer at DP > 1, the
    param all-gather overlapped with the next forward pass (`_finish_param_gather` before
    anything reads the weights). The switches exist for benchmarks/train_baseline.py's A/B
    runs; CPU runs get none of them."""
    dp = ps.get_data_parallel_world_size()
    config = transformer_config(
        spec,
        torch.bfloat16 if bf16 else torch.float32,
        use_cpu_init=CPU,
        fused=fused and bf16,
    )
    model = build_gpt(
        spec,
        config,
        ps.is_pipeline_first_stage(),
        ps.is_pipeline_last_stage(),
        gemm_bias=gemm_bias and not CPU,
    )
    if not CPU:
        model.cuda(torch.cuda.current_device())
    init_layout_independent(model, config, spec.training.seed)
    if bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        # On GPU, reduce-scatter gradient buckets while the backward pass still runs.
        overlap_grad_reduce=not CPU and dp > 1,
        overlap_param_gather=overlap_param_gather
        and not CPU
        and dp > 1
        and spec.parallelism.distributed_optimizer,
        use_distributed_optimizer=spec.parallelism.distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    ddp.broadcast_params()
    return [ddp], config


def _finish_param_gather(model: list) -> None:
    """With `overlap_param_gather` the optimizer step updates only this rank's shard; the other
    shards arrive during the next forward pass. Gather them now, before a checksum or a
    checkpoint reads the weights (what Megatron-LM does before saving). No-op otherwise."""
    with torch.no_grad():
        for chunk in model:
            if chunk.ddp_config.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)


def _build_optimizer(spec: RunSpec, model: list, bf16: bool, fused_adam: bool = True) -> object:
    """Megatron's optimizer; on GPU with torch's fused AdamW kernel unless `fused_adam` is off
    (for benchmarks/train_baseline.py's A/B runs)."""
    t = spec.training
    cfg = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        clip_grad=t.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=spec.parallelism.distributed_optimizer,
        # A constant scale of 1 turns on Megatron's found-inf check: a step whose grads hold
        # NaN/Inf is skipped instead of writing NaN into the weights. Megatron runs that check
        # only in its mixed-precision optimizers (bf16 or distributed); fp32 without the
        # distributed optimizer gets `_check_found_inf`.
        loss_scale=1.0,
    )
    optimizer = _check_found_inf(get_megatron_optimizer(cfg, model))
    if fused_adam:
        _fuse_adam(optimizer)
    return optimizer


def _fuse_adam(optimizer: object) -> None:
    """GPU: switch Megatron's torch AdamW (its fallback without apex/TransformerEngine, built with
    the foreach default) to torch's fused kernel: one pass over param, grad and both moments
    instead of a chain of foreach ops. Same update rule. Again after a checkpoint load, which
    restores the saved param-group flags and puts the `step` counters on the CPU. No-op on CPU."""
    if CPU:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            group["foreach"], group["fused"] = False, True
            for p in group["params"]:
                state = inner.state.get(p, {})
                if "step" in state:
                    state["step"] = state["step"].to(p.device, torch.float32)


def _check_found_inf(optimizer: object) -> object:
    """Give Megatron's FP32Optimizer the found-inf skip its mixed-precision optimizers have.

    FP32Optimizer.prepare_grads always reports "no inf", so a NaN gradient is applied and the
    weights stay NaN for good (T4); the step's grad norm is NaN too, which its skip threshold
    (`norm > threshold`) never catches. Like `_unscale_main_grads_and_check_for_nan`, the flag
    is max-reduced over the grad-stats group so every rank skips the same step; every rank
    takes part in that reduction, a stub optimizer (no params) included.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, FP32Optimizer):
            opt.prepare_grads = functools.partial(_prepare_grads_found_inf, opt, opt.prepare_grads)
    return optimizer


@torch.no_grad()
def _prepare_grads_found_inf(opt: FP32Optimizer, prepare: Callable[[], bool]) -> bool:
    """FP32Optimizer.prepare_grads (main_grad → grad), then: does any grad hold NaN/Inf?"""
    found = prepare()
    grads = [p.grad for g in opt.optimizer.param_groups for p in g["params"] if p.grad is not None]
    flag = torch.zeros(1, dtype=torch.float32, device=cpu_compat.collective_device())
    if grads:
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        flag.fill_(0.0 if bool(finite) else 1.0)
    torch.distributed.all_reduce(
        flag, op=torch.distributed.ReduceOp.MAX, group=opt.get_grad_stats_parallel_group()
    )
    return found or flag.item() > 0


def _set_lr(optimizer: object, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def run(spec: RunSpec, ctx: TrainContext) -> TrainResult:
    entered = time.time()
    stop = _StopFlag()
    stop.install()
    setup = _SetupClock()
    rank, world, local_rank, device = _init_distributed()
    p = spec.parallelism
    if p.virtual_pipeline:
        raise ValueError("virtual pipeline stages are not supported by megatron_runs yet")
    if p.sequence_parallel:
        raise ValueError("sequence parallel needs apex/TransformerEngine norms; not supported")
    if world != p.world_size:
        raise ValueError(f"WORLD_SIZE {world} != tensor×pipeline×data {p.world_size}")
    ps.initialize_model_parallel(p.tensor, p.pipeline)
    setup.mark("distributed_init")
    log = _Log(ctx, rank)
    t = spec.training
    torch.manual_seed(t.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
    bf16 = spec.model.precision == "bf16" and not CPU
    stream = TokenStream(_data_prefix(spec), spec.model.seq_length)
    model, config = _build_model(spec, bf16)
    optimizer = _build_optimizer(spec, model, bf16)
    setup.mark("model_and_optimizer")
    nodes = _job_nodes(ctx.node)
    node_index = nodes.index(ctx.node)
    faults = Faults.for_process(spec, ctx.node, rank, ctx.checkpoint_dir, local_rank, nodes)
    current = [0]  # the step being computed, for the NaN-grad hook
    # Every rank checks whether its own gradients were finite before reduction (after it,
    # every rank holds the NaN, and only this tells where it was made); the step's all-reduce
    # carries one flag per node, so a node's exporter counts a NaN made by any of its devices.
    # Not with overlapped grad reduction (GPU, DP > 1): the buckets are already being reduced
    # in place when the backward pass ends.
    overlapped = getattr(getattr(model[0], "ddp_config", None), "overlap_grad_reduce", False)
    local_grads: list[torch.Tensor | None] = [None]
    _hook_finalize(config, model, faults, current, None if overlapped else local_grads)
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model[0].no_sync

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    layout = {"tensor": p.tensor, "pipeline": p.pipeline, "data": dp_size}
    root = Path(ctx.checkpoint_dir)

    step, cursor = 0, 0
    setup.mark("other")
    info = ck.choose(root, ctx.resume_step)
    resumed_from = info.step if info is not None else None
    if ctx.resume_step and (info is None or info.step != ctx.resume_step):
        log("resume_step_unavailable", asked=ctx.resume_step, using=info.step if info else 0)
    if info is not None:
        t0 = time.perf_counter()
        loaded = dist_ckpt.load(model, optimizer, info)
        _fuse_adam(optimizer)
        step, cursor = loaded.step, loaded.consumed_samples
        log("checkpoint_loaded", step=step, path=str(info.path), seconds=time.perf_counter() - t0)
        setup.mark("checkpoint_load")
        if rank == 0:
            try:
                ck.unpin_below(root, step)
            except OSError as exc:  # housekeeping: never worth a crash loop
                log("unpin_failed", error=repr(exc))

    metrics = None
    if ctx.metrics_port is not None and local_rank == 0:
        metrics = _serve_metrics(ctx, rank, t.train_steps, step, cursor, log)

    fwd_bwd = get_forward_backward_func()
    last_stage_reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    num_micro = t.global_batch_size // (t.micro_batch_size * dp_size)
    tokens_per_step = t.global_batch_size * spec.model.seq_length
    peak = peak_flops(device) * world
    flops_step = flops_per_token(spec) * tokens_per_step
    losses: list[float] = []
    check_every = _replica_check_every()
    last_loss = math.nan
    exit_code = exitcodes.OK
    checkpoints = Checkpointer(spec.checkpoint, root, layout, resumed_from, metrics, faults, log)
    target = t.train_steps if ctx.stop_at_step is None else min(t.train_steps, ctx.stop_at_step)
    setup.mark("other")
    log(
        "train_start", step=step, cursor=cursor, target=target, layout=layout, cpu=CPU,
        nodes=nodes, entered=round(entered, 3), setup_seconds=setup.seconds,
    )  # fmt: skip

    while step < target:
        step_start = time.perf_counter()
        next_step = step + 1
        faults.before_step(next_step)
        if metrics is not None:
            metrics.on_step_entered(next_step)
        # First, so that the GPU clears the grad buffers while the host assembles the batch.
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        lr = lr_at(next_step, t)
        _set_lr(optimizer, lr)
        taken = take_step(cursor, t.global_batch_size, ctx.skip_ranges)
        mine = rank_slice(taken.indices, dp_rank, dp_size)
        batches = build_microbatches(
            stream, mine, t.micro_batch_size, t.seed, spec.model.vocab_size, faults.poison_effect
        )
        current[0] = next_step
        out = fwd_bwd(
            forward_step_func=_forward_step,
            data_iterator=to_device(batches, device),
            model=model,
            num_microbatches=num_micro,
            seq_length=spec.model.seq_length,
            micro_batch_size=t.micro_batch_size,
            decoder_seq_length=spec.model.seq_length,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        busy = time.perf_counter() - step_start
        delay = faults.slow_delay(next_step, busy)
        if delay:
            time.sleep(delay)
            busy += delay
        # Loss sum, microbatch count, stop signal and the nodes that made non-finite grads:
        # one all-reduce and one host sync per step.
        reported = float(len(out)) if last_stage_reporter else 0.0
        stats = torch.tensor(
            [0.0, reported, float(stop.signum)] + [0.0] * len(nodes),
            dtype=torch.float64,
            device=device,
        )
        if last_stage_reporter and out:
            stats[0] = torch.stack([d["lm loss"] for d in out]).double().sum()
        if local_grads[0] is not None:
            stats[STATS_FIXED + node_index] = (~local_grads[0]).double()
        torch.distributed.all_reduce(stats)
        loss_sum, count, signum, *made_nan = stats.tolist()
        loss = loss_sum / count if count > 0 else math.nan
        stop_requested = signum > 0
        norm = float(grad_norm) if ok and grad_norm is not None else math.nan
        step, cursor = next_step, taken.next_cursor
        last_loss = loss
        losses.append(loss)
        wall = time.perf_counter() - step_start
        if metrics is not None:
            metrics.on_step(
                StepReport(
                    step=step,
                    loss=loss,
                    grad_norm=norm,
                    lr=lr,
                    tokens=tokens_per_step,
                    samples_consumed=cursor,
                    skipped=taken.skipped,
                    step_time=wall,
                    node_step_time=busy,
                    mfu=flops_step / (wall * peak) if peak else 0.0,
                    local_grads_finite=made_nan[node_index] == 0,
                )
            )
        if step % t.log_interval == 0 or not ok:
            log(
                "step",
                step=step,
                loss=loss,
                grad_norm=norm,
                lr=lr,
                skipped_update=not ok,
                nonfinite_nodes=[n for n, bad in zip(nodes, made_nan, strict=True) if bad],
                step_time=round(wall, 4),
                consumed=cursor,
            )
        if check_every and step % check_every == 0:
            _finish_param_gather(model)
            mismatch = replicas.check(model, device)
            if metrics is not None:
                metrics.on_replica_check(mismatch)
            log("replica_mismatch" if mismatch else "replica_check", step=step)
        checkpoints.poll()
        final = step >= target or stop_requested
        if step % spec.checkpoint.interval_steps == 0 or final:
            _finish_param_gather(model)
            checkpoints.save(model, optimizer, step, cursor, loss)
        if stop_requested and step < target:  # a signal at the last step changes nothing
            log("stopping_on_signal", step=step, signal=int(signum))
            exit_code = exitcodes.REQUEUE
            break

    checkpoints.finish()
    if metrics is not None:
        metrics.set_up(False)
    log("train_end", step=step, loss=last_loss, exit_code=exit_code)
    return TrainResult(exit_code=exit_code, final_step=step, consumed_samples=cursor, losses=losses)


def _serve_metrics(
    ctx: TrainContext, rank: int, target_steps: int, step: int, cursor: int, log: _Log
) -> TrainMetrics:
    """This node's endpoint (local rank 0 only); run-level series on global rank 0's node.

    Binds NIGHTWATCH_METRICS_HOST (default 127.0.0.1; the worker sets the node's address
    when Prometheus scrapes from elsewhere).
    """
    metrics = TrainMetrics(ctx.run_id, ctx.attempt, ctx.node, run_level=rank == 0)
    host = os.environ.get("NIGHTWATCH_METRICS_HOST", "127.0.0.1")
    port = metrics.serve(host, ctx.metrics_port or 0)
    metrics.start(target_steps, step, cursor)
    metrics.set_up(True)
    if ctx.on_metrics_ready is not None:
        ctx.on_metrics_ready(host, port)
    log("metrics_ready", all_ranks=True, host=host, port=port)
    return metrics


def _forward_step(data_iterator: object, model: object) -> tuple[torch.Tensor, Callable]:
    """One microbatch: per-token losses out, a loss function that weights them."""
    b: MicroBatch = next(data_iterator)
    per_token = model(b.tokens, b.position_ids, None, labels=b.labels)

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        weighted = output.float().reshape(-1) * b.loss_mask.reshape(-1)
        loss = weighted.sum() / b.loss_mask.numel()
        # The schedule divides the returned loss in place: report a detached copy.
        return loss, {"lm loss": loss.detach().clone()}

    return per_token, loss_func


def _hook_finalize(
    config: object,
    model: list,
    faults: Faults,
    current: list[int],
    local_grads: list[torch.Tensor | None] | None,
) -> None:
    """Grad reduction, with injected NaN grads on a sick node before they are reduced, and,
    into `local_grads[0]` when given, whether this rank's own gradients were all finite
    (a 0-d bool tensor, read with the step's other host syncs; one fp32 sum per buffer)."""

    def finalize(*args: object, **kwargs: object) -> None:
        if faults.nan_grads(current[0]):
            for chunk in model:
                for buf in chunk.buffers:
                    buf.grad_data.view(-1)[0] = math.nan
        if local_grads is not None:
            sums = [b.grad_data.sum(dtype=torch.float32) for c in model for b in c.buffers]
            local_grads[0] = torch.isfinite(torch.stack(sums).sum()) if sums else None
        finalize_model_grads(*args, **kwargs)

    config.finalize_model_grads_func = finalize
