"""Save and load model + optimizer with megatron `dist_checkpointing`, published atomically.

Collective: every rank calls `save` / `load`. The checkpoint directory must be shared by all
ranks (as dist_checkpointing requires). The optimizer state uses the `fully_reshardable`
format: the default fails, and `dp_reshardable` cannot change TP/PP and resumes Adam at step 1.
"""

from __future__ import annotations

import os
import queue
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException

from contracts import checkpoints as ck
from megatron_runs.cpu_compat import collective_device

_OPT_META = {"distrib_optim_sharding_type": "fully_reshardable"}


class SaveFailed(Exception):
    """Rank 0 could not publish the save; raised on every rank alike, so all go on in step."""


#: What a save may fail with while the process group stays sound: storage, not communication.
#: A collective that failed (a peer died mid-save) is none of these and must end the rank.
STORAGE_ERRORS: tuple[type[Exception], ...] = (OSError, CheckpointingException, SaveFailed)


@dataclass(frozen=True)
class Loaded:
    step: int
    consumed_samples: int
    path: Path


def _unwrap(chunk: object) -> object:
    """The GPTModel inside DDP / Float16Module: its keys do not depend on the wrapping, so a
    checkpoint loads whatever the precision or DDP settings of the resuming run."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _state_dict(model: list, optimizer: object, is_loading: bool) -> dict:
    sd: dict = {}
    if len(model) == 1:
        sd["model"] = _unwrap(model[0]).sharded_state_dict()
    else:
        for i, chunk in enumerate(model):
            sd[f"model{i}"] = _unwrap(chunk).sharded_state_dict()
    model_sd = {k: v for k, v in sd.items() if k.startswith("model")}
    merged = model_sd["model"] if len(model) == 1 else model_sd
    _gather_in_buffer_space(optimizer)
    sd["optimizer"] = optimizer.sharded_state_dict(
        merged, is_loading=is_loading, metadata=_OPT_META
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
    diverges (T1: +0.5 loss). Loading slices per parameter and is right, so the fix is on the
    gather side: put every bucket back at its buffer offset. The checkpoint format is unchanged
    (it was already correct for single-bucket buffers); checkpoints saved before this fix with
    inter-bucket padding hold shifted optimizer state.
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
    """A buffer-sized tensor with each bucket's unpadded part of `compact` at its offset."""
    full = compact.new_zeros(buffer.numel)
    start = 0
    for bucket in buffer.buckets:
        n = bucket.numel_unpadded
        full[bucket.offset : bucket.offset + n] = compact[start : start + n]
        start += n
    return full


def _in_process_results_queue() -> None:
    """Keep megatron-core's write-results queue in this process.

    Synchronous saves write from threads of this process, yet megatron-core 0.19.2 creates the
    results queue through a spawned multiprocessing Manager: a fresh interpreter started on the
    first save (seconds of fixed cost) that is never stopped and outlives a killed rank as an
    orphan. Seeding the module's queue with a plain `queue.Queue` avoids both. Only valid while
    saves are synchronous (we never use async_sharded_save).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _barrier() -> None:
    torch.distributed.barrier()


def save(
    model: list,
    optimizer: object,
    root: Path,
    step: int,
    consumed_samples: int,
    loss: float | None,
    layout: dict[str, int],
    keep_last: int,
    protect: set[int] | None = None,
    keep_seconds: float = 0.0,
) -> Path:
    """Write to `.tmp_iter_*`, verify, rename, update `latest`, apply retention (sparing the
    steps in `protect` and those saved within `keep_seconds` of this one)."""
    _in_process_results_queue()
    rank = torch.distributed.get_rank()
    tmp = ck.tmp_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    dist_checkpointing.save(_state_dict(model, optimizer, is_loading=False), str(tmp))
    _barrier()
    problem = None
    if rank == 0:
        try:
            _fsync_tree(tmp)
            ck.write_meta(tmp, step, consumed_samples, loss, layout)
            ck.publish(root, step)
            ck.retain(root, keep_last, protect, keep_seconds)
        except Exception as exc:  # local file work only: no collective was skipped
            problem = repr(exc)
    if not _all_ranks_ok(problem is None):
        raise SaveFailed(f"step {step} not published: {problem or 'see rank 0'}")
    return ck.step_dir(root, step)


def _all_ranks_ok(ok: bool) -> bool:
    """The closing barrier, carrying whether this rank's part went well: every rank learns
    the outcome at the same collective, so a failure on rank 0 alone leaves no rank waiting
    in a barrier the others skipped."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=collective_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def load(model: list, optimizer: object, info: ck.CheckpointInfo) -> Loaded:
    """Load model and optimizer state in place from a verified checkpoint."""
    _init_adam_state(optimizer)
    state = dist_checkpointing.load(_state_dict(model, optimizer, is_loading=True), str(info.path))
    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model):
            _unwrap(chunk).load_state_dict(state[f"model{i}"])
    _skip_step_in_param_state(optimizer)
    optimizer.load_state_dict(state["optimizer"])
    _unshare_adam_steps(optimizer)
    return Loaded(step=info.step, consumed_samples=info.consumed_samples, path=info.path)


def _inner_optimizers(optimizer: object) -> list:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt.optimizer for opt in chained if getattr(opt, "optimizer", None) is not None]


def _init_adam_state(optimizer: object) -> None:
    """Create zero Adam state (moments and `step`) for a fresh optimizer.

    Building the loading state dict reads the current state, and without apex/TE the
    distributed optimizer requires a `step` in it; a fresh torch Adam has no state at all.
    """
    for inner in _inner_optimizers(optimizer):
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
    for inner in _inner_optimizers(optimizer):
        for st in inner.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
