"""One attempt's set-up on one rank: distributed init, model, optimizer, data, faults, resume.

`set_up` returns a `Trainer`, everything `loop.run` needs to step. `init_distributed`,
`init_model_parallel` and `build_model` are public for benchmarks/train_baseline.py, which
measures the same model without the loop.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
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
from megatron.core.transformer.module import Float16Module  # noqa: E402

from contracts import checkpoints as ck  # noqa: E402
from contracts.paths import nightwatch_home  # noqa: E402
from contracts.spec import RunSpec  # noqa: E402
from contracts.task import TrainContext  # noqa: E402
from megatron_runs import blend, dist_ckpt, memory_tier  # noqa: E402
from megatron_runs.data import Source, TokenStream  # noqa: E402
from megatron_runs.data_prep import prepare  # noqa: E402
from megatron_runs.faults import Faults  # noqa: E402
from megatron_runs.memory_tier import MemoryTier  # noqa: E402
from megatron_runs.metrics import TrainMetrics  # noqa: E402
from megatron_runs.model import build_gpt, init_layout_independent, transformer_config  # noqa: E402
from megatron_runs.optimizer import build_optimizer, fuse_adam  # noqa: E402


class Log:
    """JSON-lines log on stderr, with run_id / attempt / job_id on every line."""

    def __init__(self, ctx: TrainContext, rank: int) -> None:
        self.base = {
            "run_id": ctx.run_id,
            "attempt": ctx.attempt,
            "job_id": os.environ.get("NIGHTWATCH_JOB_ID") or os.environ.get("SLURM_JOB_ID"),
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


class SetupClock:
    """Where an attempt's start-up goes (seconds per phase, in the train_start line): a
    restart's cost is read from these, not guessed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - self._last, 3)
        self._last = now


class StopFlag:
    """Set by USR2/TERM; acted on at the next step boundary.

    Installed first thing in `loop.run`, so a preemption during set-up or checkpoint loading
    (seconds) still ends in a checkpoint and exit 75 instead of TERM's default kill. A handler
    installed before it that remembered a signal (worker.task's `_EarlyStop`, which covers the
    import of the loop) hands that signal over instead of losing it.
    """

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> None:
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            previous = signal.signal(sig, self._handler)
            self.signum = self.signum or getattr(previous, "signum", None) or 0

    def _handler(self, signum: int, _frame: object) -> None:
        self.signum = signum


@dataclass
class Trainer:
    """What set-up hands the loop: this rank's place in the job, the model and its optimizer,
    the data, the faults, and the step and sample cursor to go on from."""

    log: Log
    rank: int
    world: int
    device: torch.device
    model: list
    optimizer: object
    #: The training samples by global sample index, and the valid samples (data.split).
    source: Source
    valid: Source | None
    #: The job's nodes in rank order, this rank's node's place among them, and every global
    #: rank's (the step's all-reduce carries per-rank figures the loop reads per node).
    nodes: list[str]
    node_index: int
    rank_nodes: tuple[int, ...]
    faults: Faults
    #: Whether this rank's own gradients were all finite before reduction (a 0-d bool tensor
    #: written by the grad-finalize hook; stays None with overlapped grad reduction).
    local_grads: list[torch.Tensor | None]
    dp_rank: int
    dp_size: int
    layout: dict[str, int]
    #: The model features this rank trains with, as megatron was configured (the
    #: `train_start` line names them): sequence parallelism, recomputation, model chunks.
    features: dict[str, object]
    root: Path
    step: int
    cursor: int
    resumed_from: int | None
    metrics: TrainMetrics | None
    #: The good steps' losses the resumed checkpoint kept for the spike judgement.
    loss_trend: tuple[float, ...] = ()
    #: The resumed checkpoint's newest evaluation (step, validation loss), then the loop's.
    last_eval: tuple[int, float] | None = None
    #: The rank's in-memory checkpoint tier, when its node task keeps one.
    memory_tier: MemoryTier | None = None


def set_up(spec: RunSpec, ctx: TrainContext, clock: SetupClock) -> Trainer:
    """Everything before the first step, each phase timed on `clock`; a checkpoint in
    `ctx.checkpoint_dir` (the newest, or `ctx.resume_step`'s) is loaded."""
    # Before the process group: Megatron's dataset builder builds on every rank alone then.
    source, valid = _data(spec)
    clock.mark("data")
    rank, world, local_rank, device = init_distributed()
    p = spec.parallelism
    if world != p.world_size:
        raise ValueError(f"WORLD_SIZE {world} != tensor×pipeline×data {p.world_size}")
    init_model_parallel(spec)
    clock.mark("distributed_init")
    log = Log(ctx, rank)
    t = spec.training
    torch.manual_seed(t.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
    bf16 = spec.model.precision == "bf16" and not CPU
    model, config = build_model(spec, bf16)
    optimizer = build_optimizer(spec, model, bf16)
    clock.mark("model_and_optimizer")
    nodes, rank_nodes = _job_nodes(ctx.node)
    faults = Faults.for_process(spec, ctx.node, rank, ctx.checkpoint_dir, local_rank, nodes)
    # Every rank checks whether its own gradients were finite before reduction (after it,
    # every rank holds the NaN, and only this tells where it was made); the step's all-reduce
    # carries one flag per node, so a node's exporter counts a NaN made by any of its devices.
    # Not with overlapped grad reduction (GPU, DP > 1): the buckets are already being reduced
    # in place when the backward pass ends.
    overlapped = getattr(getattr(model[0], "ddp_config", None), "overlap_grad_reduce", False)
    local_grads: list[torch.Tensor | None] = [None]
    _hook_finalize(config, model, faults, None if overlapped else local_grads)
    config.grad_scale_func = optimizer.scale_loss
    dp_size = ps.get_data_parallel_world_size()
    root = Path(ctx.checkpoint_dir)
    clock.mark("other")
    tier = MemoryTier.from_env() if spec.checkpoint.in_memory else None
    step, cursor, resumed_from, loss_trend, last_eval = _resume(
        model, optimizer, root, ctx, rank, world, spec.checkpoint.in_memory, tier, log, clock
    )
    metrics = None
    if ctx.metrics_port is not None and local_rank == 0:
        metrics = _serve_metrics(ctx, rank, t.train_steps, step, cursor, log)
        metrics.on_resumed_eval(last_eval)
    return Trainer(
        log=log, rank=rank, world=world, device=device, model=model, optimizer=optimizer,
        source=source, valid=valid, nodes=nodes, node_index=nodes.index(ctx.node),
        rank_nodes=rank_nodes, faults=faults,
        local_grads=local_grads, dp_rank=ps.get_data_parallel_rank(), dp_size=dp_size,
        layout={"tensor": p.tensor, "pipeline": p.pipeline, "data": dp_size},
        features={
            "sequence_parallel": config.sequence_parallel,
            "recompute": config.recompute_granularity or "none",
            "model_chunks": len(model),
        },
        root=root,
        step=step, cursor=cursor, resumed_from=resumed_from, metrics=metrics,
        loss_trend=loss_trend, last_eval=last_eval, memory_tier=tier,
    )  # fmt: skip


#: How often a rank looks for the master's store before it joins: torch's client retries a
#: refused connection with a jittered backoff, which measured 0.3-0.6 s here when the master
#: came up 50-300 ms after the rank (a restart whose master node reaps its old ranks first).
MASTER_POLL_S = 0.01
#: How long it looks; then torch's rendezvous goes on as it would have (with its timeout).
MASTER_WAIT_S = 120.0


def wait_for_master(addr: str, port: int, timeout_s: float = MASTER_WAIT_S) -> bool:
    """Return once the master's TCP store accepts a connection (True), or after `timeout_s`
    (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(MASTER_POLL_S)


def init_distributed() -> tuple[int, int, int, torch.device]:
    """This rank's place (RANK, WORLD_SIZE, LOCAL_RANK) and device; the process group joined
    over gloo on CPU, NCCL on GPU (a rank other than the master first waits for the master's
    store: `wait_for_master`)."""
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
        if rank != 0:
            wait_for_master(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        torch.distributed.init_process_group(
            backend=backend, rank=rank, world_size=world, device_id=None if CPU else device
        )
    return rank, world, local_rank, device


def init_model_parallel(spec: RunSpec) -> None:
    """Megatron's tensor / pipeline groups, and the model chunks per rank of an interleaved
    pipeline (`parallelism.virtual_pipeline`)."""
    p = spec.parallelism
    ps.initialize_model_parallel(
        p.tensor, p.pipeline, virtual_pipeline_model_parallel_size=p.virtual_pipeline
    )


def _job_nodes(node: str) -> tuple[list[str], tuple[int, ...]]:
    """Every node of this process group, in rank order without repeats (the log then says
    where each attempt ran: a sick node's fault strikes only where a job lands on it), and
    each global rank's node as its place among them."""
    names: list[str] = [""] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, node)
    nodes = list(dict.fromkeys(names))
    return nodes, tuple(nodes.index(n) for n in names)


def _data(spec: RunSpec) -> tuple[Source, Source | None]:
    """The training samples and the valid ones: one prefix (or the demo corpus) without a
    split read as a `TokenStream`, anything else through Megatron's datasets (`blend`)."""
    demo = None
    if spec.data.prefix is None and spec.data.blend is None:
        demo = prepare(None, nightwatch_home() / "data", spec.model.vocab_size).prefix
    if not spec.data.megatron:
        return TokenStream(
            spec.data.prefix or demo, spec.model.seq_length, spec.training.seed
        ), None
    return blend.build(spec, demo)


def build_model(
    spec: RunSpec,
    bf16: bool,
    fused: bool = True,
    overlap_param_gather: bool = True,
    gemm_bias: bool = True,
) -> tuple[list, object]:
    """The DDP-wrapped model: one chunk, or `parallelism.virtual_pipeline` chunks per rank for
    the interleaved schedule, each with its own DDP as in Megatron-LM (bucketed grad reduction
    for the first chunk only); the config's sync hooks point at every chunk. On GPU by
    default: fused bias-dropout-add and cross-entropy (bf16 only, see `transformer_config`),
    QKV and fc1 biases added inside their GEMMs (`model.GemmBiasColumnParallelLinear`) and,
    with the distributed optimizer at DP > 1, the param all-gather overlapped with the next
    forward pass (`loop.finish_param_gather` before anything reads the weights). The switches
    exist for benchmarks/train_baseline.py's A/B runs; CPU runs get none of them."""
    dp = ps.get_data_parallel_world_size()
    config = transformer_config(
        spec,
        torch.bfloat16 if bf16 else torch.float32,
        use_cpu_init=CPU,
        fused=fused and bf16,
    )
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
    vp = spec.parallelism.virtual_pipeline
    model = []
    for vp_stage in range(vp) if vp else [None]:
        gpt = build_gpt(
            spec,
            config,
            ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            gemm_bias=gemm_bias and not CPU,
            vp_stage=vp_stage,
        )
        if not CPU:
            gpt.cuda(torch.cuda.current_device())
        init_layout_independent(gpt, config, spec.training.seed)
        chunk = Float16Module(config, gpt) if bf16 else gpt
        ddp = DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=bool(vp_stage))
        ddp.broadcast_params()
        model.append(ddp)
    _hook_sync(config, model)
    return model, config


def _hook_sync(config: object, model: list) -> None:
    """The schedules' sync hooks: grad reduction held back during gradient accumulation (one
    hook per chunk); with several chunks, also as Megatron-LM wires them (align_grad_reduce,
    align_param_gather): each chunk's overlapped grad reduction started as soon as its last
    backward ends, and its overlapped param all-gather before its first forward."""
    if len(model) == 1:
        config.no_sync_func = model[0].no_sync
        return
    config.no_sync_func = [chunk.no_sync for chunk in model]
    ddp_config = model[0].ddp_config
    if ddp_config.overlap_grad_reduce:
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
    if ddp_config.overlap_param_gather:
        config.param_sync_func = [chunk.start_param_sync for chunk in model]


def _hook_finalize(
    config: object,
    model: list,
    faults: Faults,
    local_grads: list[torch.Tensor | None] | None,
) -> None:
    """Grad reduction, with injected NaN grads on a sick node before they are reduced, and,
    into `local_grads[0]` when given, whether this rank's own gradients were all finite
    (a 0-d bool tensor, read with the step's other host syncs; one fp32 sum per buffer)."""

    def finalize(*args: object, **kwargs: object) -> None:
        faults.poison_grads(model)
        if local_grads is not None:
            sums = [b.grad_data.sum(dtype=torch.float32) for c in model for b in c.buffers]
            local_grads[0] = torch.isfinite(torch.stack(sums).sum()) if sums else None
        finalize_model_grads(*args, **kwargs)

    config.finalize_model_grads_func = finalize


def _resume(
    model: list,
    optimizer: object,
    root: Path,
    ctx: TrainContext,
    rank: int,
    world: int,
    in_memory: bool,
    tier: MemoryTier | None,
    log: Log,
    clock: SetupClock,
) -> tuple[int, int, int | None, tuple[float, ...], tuple[int, float] | None]:
    """Load the checkpoint to go on from: (step, sample cursor, the step resumed from, its
    loss trend, its last evaluation); from scratch (0, 0, None, (), None) when `root` holds
    none. From the memory tier when every rank holds it there, else from disk. Rank 0 then
    unpins the older checkpoints."""
    info = ck.choose(root, ctx.resume_step)
    if ctx.resume_step and (info is None or info.step != ctx.resume_step):
        log("resume_step_unavailable", asked=ctx.resume_step, using=info.step if info else 0)
    if info is None:
        return 0, 0, None, (), None
    t0 = time.perf_counter()
    source = "disk"
    if in_memory:  # the same on every rank: all of them take part in the agreement
        found = _memory_slot(model, optimizer, info, rank, world, tier, log)
        if dist_ckpt.all_ranks_ok(found is not None):
            assert tier is not None and found is not None
            tier.load(*found)
            source = "memory"
    if source == "disk":
        dist_ckpt.load(model, optimizer, info)
    fuse_adam(optimizer)
    log("checkpoint_loaded", step=info.step, path=str(info.path), source=source,
        seconds=time.perf_counter() - t0)  # fmt: skip
    clock.mark("checkpoint_load")
    if rank == 0:
        try:
            ck.unpin_below(root, info.step)
        except OSError as exc:  # housekeeping: never worth a crash loop
            log("unpin_failed", error=repr(exc))
    return info.step, info.consumed_samples, info.step, info.loss_trend, info.last_eval


def _memory_slot(
    model: list,
    optimizer: object,
    info: ck.CheckpointInfo,
    rank: int,
    world: int,
    tier: MemoryTier | None,
    log: Log,
) -> tuple[int, memory_tier.Named] | None:
    """This rank's memory tier slot holding `info`, with the tensors to load it into; None
    when it has none. Never raises: every rank must reach the agreement that follows."""
    if tier is None:
        return None
    try:
        dist_ckpt.init_adam_state(optimizer)
        tensors = memory_tier.state_tensors(model, optimizer)
        ident = memory_tier.identity(info.step, info.consumed_samples, info.loss, rank, world)
        slot = tier.open(ident, tensors)
    except Exception as exc:  # any failure only sends this resume to disk
        log("memory_tier_failed", all_ranks=True, error=repr(exc))
        return None
    return None if slot is None else (slot, tensors)


def _serve_metrics(
    ctx: TrainContext, rank: int, target_steps: int, step: int, cursor: int, log: Log
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
