"""Save and load model + optimizer with megatron `dist_checkpointing`, published atomically.

Collective: every rank calls `save` / `load`. The checkpoint directory must be shared by all
ranks (as dist_checkpointing requires). The distributed optimizer's state is saved in model
space, each data-parallel rank its own slice (`model_space`): no gather before the write, and
it loads onto any TP × PP × DP layout. `fully_reshardable` (every rank gathers the whole state
first) can still be chosen per `Writer`; a load reads the format the checkpoint names, and
a checkpoint that names none is `fully_reshardable` (what Nightwatch wrote before).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from contracts import checkpoints as ck
from megatron_runs import async_save, model_space
from megatron_runs.cpu_compat import collective_device

logger = logging.getLogger(__name__)

SaveStrategy = TorchDistSaveShardedStrategy | FullyParallelSaveStrategyWrapper

_FORMAT_KEY = "distrib_optim_sharding_type"
#: The optimizer format of checkpoints that name none: Nightwatch's before model space.
_UNNAMED_FORMAT = "fully_reshardable"
#: The optimizer formats a `Writer` may save in.
FORMATS = (model_space.FORMAT, "fully_reshardable")


class SaveFailed(Exception):
    """Rank 0 could not publish the save; raised on every rank alike, so all go on in step."""


#: What a save may fail with while the process group stays sound: storage, not communication.
#: A collective that failed (a peer died mid-save) is none of these and must end the rank.
#: torch's `CheckpointException` is a writer's failure (a full disk) that megatron broadcast
#: before every rank raised it (`save_state_dict_async_finalize`).
STORAGE_ERRORS: tuple[type[Exception], ...] = (
    OSError, CheckpointingException, CheckpointException, SaveFailed,
)  # fmt: skip


@dataclass
class Phases:
    """Seconds per phase of one save, summed by name (the benchmark and the log read them)."""

    seconds: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.perf_counter)

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


@dataclass(frozen=True)
class Loaded:
    step: int
    consumed_samples: int
    path: Path


def unwrap(chunk: object) -> object:
    """The GPTModel inside DDP / Float16Module: its keys do not depend on the wrapping, so a
    checkpoint loads whatever the precision or DDP settings of the resuming run."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _state_dict(model: list, optimizer: object, is_loading: bool, optimizer_format: str) -> dict:
    sd: dict = {}
    if len(model) == 1:
        sd["model"] = unwrap(model[0]).sharded_state_dict()
    else:
        for i, chunk in enumerate(model):
            sd[f"model{i}"] = unwrap(chunk).sharded_state_dict()
    model_sd = {k: v for k, v in sd.items() if k.startswith("model")}
    merged = model_sd["model"] if len(model) == 1 else model_sd
    if optimizer_format == model_space.FORMAT:
        model_space.install(optimizer)
    else:
        _gather_in_buffer_space(optimizer)
    sd["optimizer"] = optimizer.sharded_state_dict(
        merged, is_loading=is_loading, metadata={_FORMAT_KEY: optimizer_format}
    )
    return sd


def _gather_in_buffer_space(optimizer: object) -> None:
    """Make the fully_reshardable save slice each parameter's optimizer state where it lies.

    megatron-core 0.19.2 gathers the distributed optimizer's state into one tensor per buffer
    with the padding between buckets dropped, then cuts each parameter out of it at its offset
    in the *padded* buffer. A buffer with several buckets (PP > 1 with tied embeddings: the
    shared embedding gets a bucket of its own) whose first bucket needs padding to a multiple
    of the DP size therefore saves a later bucket's params shifted — the embedding's Adam state
    and fp32 main param belong to the wrong elements. Nothing fails; the resumed run silently
    diverges. Loading slices per parameter and is right, so this gather puts every bucket
    back at its buffer offset; the checkpoint format is the same as megatron-core's.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        gather = getattr(opt, "get_parameter_state_dp_zero", None)
        if gather is None or getattr(gather, "_nightwatch", False):
            continue

        def in_buffer_space(
            *args: object, _gather: object = gather, _opt: object = opt, **kwargs: object
        ) -> dict | None:
            state = _gather(*args, **kwargs)
            if state is not None:
                for gbuf_idx, buffer in enumerate(_opt.buffers):
                    for world in state[gbuf_idx].values():
                        for key, compact in world.items():
                            if isinstance(compact, torch.Tensor):
                                world[key] = _unpack_buckets(compact, buffer)
            return state

        in_buffer_space._nightwatch = True  # type: ignore[attr-defined]
        opt.get_parameter_state_dp_zero = in_buffer_space


def _unpack_buckets(compact: torch.Tensor, buffer: object) -> torch.Tensor:
    """A buffer-sized tensor with each bucket's unpadded part of `compact` at its offset;
    `compact` itself when no bucket but the last is padded (no copy of the whole state)."""
    start = 0
    for bucket in buffer.buckets:
        if bucket.offset != start:
            break
        start += bucket.numel_unpadded
    else:
        return compact
    full = compact.new_zeros(buffer.numel)
    start = 0
    for bucket in buffer.buckets:
        n = bucket.numel_unpadded
        full[bucket.offset : bucket.offset + n] = compact[start : start + n]
        start += n
    return full


class _FileQueue:
    """megatron's write-results queue as one pickle file per save and rank.

    megatron-core 0.19.2's writer threads put their results (or an exception) in a module-wide
    queue, which the finalize step reads after the writes. Its default is a queue of a spawned
    multiprocessing Manager: a fresh interpreter started on the first save (seconds of fixed
    cost) that is never stopped and outlives a killed rank as an orphan. A file works in this
    process (synchronous saves write from its threads) and from the forked writer of an async
    save alike, and a pipe-backed queue would not: the forked writer blocks on a full pipe
    while this process waits for it to exit.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.unlink(missing_ok=True)

    def put(self, item: object) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(pickle.dumps(item))
        os.replace(tmp, self.path)

    def get_nowait(self) -> object:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            raise queue.Empty from None
        self.path.unlink()
        return pickle.loads(data)


def _results_queue(target: Target) -> None:
    """A fresh results file for this save and rank, in the save's temp dir: the finalize reads
    and removes it before the publish, and a save that never finishes leaves it where the
    temp dir's removal takes it (nothing accumulates in the nodes' /tmp)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    name = f"{ck.WRITE_RESULTS_PREFIX}{torch.distributed.get_rank()}.pkl"
    filesystem_async._results_queue = _FileQueue(ck.tmp_dir(target.root, target.step) / name)


def _barrier() -> None:
    torch.distributed.barrier()


@dataclass(frozen=True)
class Target:
    """What one save publishes and what retention keeps afterwards (`ck.retain`)."""

    root: Path
    step: int
    consumed_samples: int
    loss: float | None
    layout: dict[str, int]
    keep_last: int
    protect: frozenset[int] = frozenset()
    keep_seconds: float = 0.0
    loss_trend: tuple[float, ...] = ()
    #: The newest evaluation at or before `step`: (its step, validation loss).
    last_eval: tuple[int, float] | None = None


class Writer:
    """The checkpoint saves of one training process (collective: every rank calls alike).

    A save writes to `.tmp_iter_*`, makes it durable, writes `nightwatch.json`, renames it into
    place, replaces `latest` and applies retention; nothing looks complete before all of that.
    `save` does it at once; `start` plans megatron-core's asynchronous save and starts the copy
    of the state to host memory beside training; a writer process per rank, forked once the
    copy is done, writes it, and the returned `async_save.PendingSave` publishes once every
    rank's writer finished.

    With `spread_replicas` (the default) each data-parallel replica writes 1/DP of the
    replicated tensors (megatron's FullyParallelSaveStrategyWrapper, Megatron-LM's default);
    without it, megatron's default strategy: DP rank 0 alone writes every replicated tensor,
    the whole model and, fully_reshardable, the whole optimizer state. The shard distribution,
    the sharding check and torch's save plan (every rank's write items, all-gathered) are
    computed on the first save only and reused (Megatron-LM's
    `--ckpt-assume-constant-structure`): the state's structure does not change within a
    process.
    """

    def __init__(
        self, optimizer_format: str = model_space.FORMAT, spread_replicas: bool = True
    ) -> None:
        if optimizer_format not in FORMATS:
            raise ValueError(f"optimizer format {optimizer_format!r} is none of {FORMATS}")
        self.optimizer_format = optimizer_format
        self.spread_replicas = spread_replicas
        self._strategy: SaveStrategy | None = None
        self._host = async_save.HostBuffers(pin=torch.cuda.is_available())
        self._stream: torch.cuda.Stream | None = None

    def save(
        self, model: list, optimizer: object, target: Target, phases: Phases | None = None
    ) -> Path:
        """Write, sync and publish; returns the published directory."""
        phases = phases if phases is not None else Phases()
        state, strategy, validate = self._prepare(model, optimizer, target, phases)
        dist_checkpointing.save(
            state, str(ck.tmp_dir(target.root, target.step)), strategy,
            validate_access_integrity=validate, content_metadata=self._content,
        )  # fmt: skip
        phases.mark("write")
        return _publish(target, phases)

    def start(
        self, model: list, optimizer: object, target: Target, phases: Phases | None = None
    ) -> async_save.PendingSave:
        """Plan the save and start copying the state to host memory; returns at once after
        (`async_save`: the writer is forked once the copy is done)."""
        phases = phases if phases is not None else Phases()
        state, strategy, validate = self._prepare(model, optimizer, target, phases)
        request = dist_checkpointing.save(
            state, str(ck.tmp_dir(target.root, target.step)), strategy,
            validate_access_integrity=validate, content_metadata=self._content,
            async_sharded_save=True, async_strategy="mcore",
        )  # fmt: skip
        phases.mark("plan")
        args = list(request.async_fn_args)
        staging, hooks = None, []
        if request.async_fn is not None and any(
            t.is_cuda for _, _, (_, tensors) in args[1] for _, t in tensors
        ):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            staging = async_save.Staging(args[1], self._host, self._stream)
            hooks = async_save.wait_before_updates(inner_optimizers(optimizer), staging.captured)
        phases.mark("stage")

        def finalize() -> Path:
            for fn in request.finalize_fns:
                fn()
            phases.mark("finalize")
            return _publish(target, phases)

        return async_save.PendingSave(
            target.step, request.async_fn, args, staging, hooks, finalize, phases
        )

    def _prepare(
        self, model: list, optimizer: object, target: Target, phases: Phases
    ) -> tuple[dict, SaveStrategy, bool]:
        _fresh_tmp(target)
        _results_queue(target)
        phases.mark("fresh_dir")
        state = _state_dict(
            model, optimizer, is_loading=False, optimizer_format=self.optimizer_format
        )
        phases.mark("state_dict")
        first = self._strategy is None
        if first:
            self._strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
            if self.spread_replicas:
                self._strategy = FullyParallelSaveStrategyWrapper(
                    self._strategy,
                    ps.get_data_parallel_group(with_context_parallel=True),
                    do_cache_distribution=True,
                )
        return state, self._strategy, first

    @property
    def _content(self) -> dict:
        """What the checkpoint records of its format, for the load to read."""
        return {_FORMAT_KEY: self.optimizer_format}


def _fresh_tmp(target: Target) -> None:
    """An empty temp dir for the step on rank 0 before any rank writes (a failed earlier
    attempt at the same step may have left one). The last save's retention may still run: it
    removes only temp dirs up to that save's step."""
    if torch.distributed.get_rank() == 0:
        tmp = ck.tmp_dir(target.root, target.step)
        target.root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()


class _Retention:
    """Retention on a thread of rank 0, so that deleting old checkpoints (seconds for a large
    one) does not hold up training. Safe to cut short: a half-deleted checkpoint fails
    verification and the next retention removes the rest."""

    _thread: threading.Thread | None = None

    @classmethod
    def start(cls, target: Target) -> None:
        cls.join()
        cls._thread = threading.Thread(
            target=cls._retain, args=(target,), name="nightwatch-retention", daemon=True
        )
        cls._thread.start()

    @classmethod
    def join(cls) -> None:
        if cls._thread is not None:
            cls._thread.join()
            cls._thread = None

    @staticmethod
    def _retain(target: Target) -> None:
        try:
            ck.retain(
                target.root, target.keep_last, set(target.protect), target.keep_seconds,
                stale_through=target.step,
            )  # fmt: skip
        except OSError as exc:  # housekeeping: the next save's retention tries again
            logger.warning("checkpoint retention under %s failed: %r", target.root, exc)


#: What megatron-core 0.19.2's writer fsyncs itself: every rank's data files (its writer
#: threads sync each one) and the torch `.metadata` file. Rank 0 syncs anything else.
_SYNCED_BY_MEGATRON = (".distcp", ".metadata")


def _publish(target: Target, phases: Phases) -> Path:
    """Rank 0 makes the written temp dir durable and publishes it; every rank learns the
    outcome at the closing all-reduce."""
    problem = None
    if torch.distributed.get_rank() == 0:
        try:
            tmp = ck.tmp_dir(target.root, target.step)
            for p in tmp.iterdir():
                if p.is_file() and not p.name.endswith(_SYNCED_BY_MEGATRON):
                    ck.fsync_path(p)
            phases.mark("fsync")
            ck.write_meta(
                tmp, target.step, target.consumed_samples, target.loss, target.layout,
                loss_trend=target.loss_trend, last_eval=target.last_eval,
            )  # fmt: skip
            phases.mark("meta")
            ck.publish(target.root, target.step)
            phases.mark("publish")
            _Retention.start(target)
        except Exception as exc:  # local file work only: no collective was skipped
            problem = repr(exc)
    ok = all_ranks_ok(problem is None)
    phases.mark("outcome")
    if not ok:
        raise SaveFailed(f"step {target.step} not published: {problem or 'see rank 0'}")
    return ck.step_dir(target.root, target.step)


def all_ranks_ok(ok: bool) -> bool:
    """The closing barrier, carrying whether this rank's part went well: every rank learns
    the outcome at the same collective, so a failure on rank 0 alone leaves no rank waiting
    in a barrier the others skipped."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=collective_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def load(model: list, optimizer: object, info: ck.CheckpointInfo) -> Loaded:
    """Load model and optimizer state in place from a verified checkpoint."""
    init_adam_state(optimizer)
    content = dist_checkpointing.load_content_metadata(str(info.path)) or {}
    optimizer_format = content.get(_FORMAT_KEY, _UNNAMED_FORMAT)
    state = dist_checkpointing.load(
        _state_dict(model, optimizer, is_loading=True, optimizer_format=optimizer_format),
        str(info.path),
    )
    if len(model) == 1:
        unwrap(model[0]).load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(state[f"model{i}"])
    _skip_step_in_param_state(optimizer)
    optimizer.load_state_dict(state["optimizer"])
    _unshare_adam_steps(optimizer)
    return Loaded(step=info.step, consumed_samples=info.consumed_samples, path=info.path)


def inner_optimizers(optimizer: object) -> list:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt.optimizer for opt in chained if getattr(opt, "optimizer", None) is not None]


def init_adam_state(optimizer: object) -> None:
    """Create zero Adam state (moments and `step`) for a fresh optimizer.

    Building the loading state dict reads the current state, and without apex/TE the
    distributed optimizer requires a `step` in it; a fresh torch Adam has no state at all.
    """
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)
                    st["step"] = torch.zeros((), dtype=torch.float32)


def _skip_step_in_param_state(optimizer: object) -> None:
    """Let the fully_reshardable parameter-state load pass over torch Adam's `step`.

    megatron-core 0.19.2 without apex/TE copies every tensor of a parameter's Adam state from
    the checkpoint, but `step` is stored once in the param groups, not per parameter, so the
    lookup raises KeyError. Marking it absent (None) makes that copy skip it; the common step
    was already restored from the param groups.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        setter = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if setter is None or getattr(setter, "_nightwatch", False):
            continue

        def tolerant(model_param: object, tensors: dict, _set: object = setter) -> None:
            _set(model_param, {"step": None, **tensors})

        tolerant._nightwatch = True  # type: ignore[attr-defined]
        opt._set_main_param_and_optimizer_states = tolerant


def _unshare_adam_steps(optimizer: object) -> None:
    """Give each parameter its own Adam `step` tensor.

    Loading the distributed optimizer state leaves one shared `step` tensor for all params;
    torch Adam increments it once per param per step, so bias correction would go wrong and
    the resumed losses would silently differ from an uninterrupted run.
    """
    for inner in inner_optimizers(optimizer):
        for st in inner.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
