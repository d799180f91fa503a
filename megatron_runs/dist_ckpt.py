"""Save and load model + optimizer with megatron `dist_checkpointing`, published atomically.

Collective: every rank calls `save` / `load`. The checkpoint directory must be shared by all
ranks (as dist_checkpointing requires). The optimizer state uses the `fully_reshardable`
format: the default fails, and `dp_reshardable` cannot change TP/PP and resumes Adam at step 1.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from megatron_runs import checkpointing as ck

_OPT_META = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass(frozen=True)
class Loaded:
    step: int
    consumed_samples: int
    path: Path


def _state_dict(model: list, optimizer: object, is_loading: bool) -> dict:
    sd: dict = {}
    if len(model) == 1:
        sd["model"] = model[0].sharded_state_dict()
    else:
        for i, chunk in enumerate(model):
            sd[f"model{i}"] = chunk.sharded_state_dict()
    model_sd = {k: v for k, v in sd.items() if k.startswith("model")}
    merged = model_sd["model"] if len(model) == 1 else model_sd
    sd["optimizer"] = optimizer.sharded_state_dict(merged, is_loading=is_loading, metadata=_OPT_META)
    return sd


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
) -> Path:
    """Write to `.tmp_iter_*`, verify, rename, update `latest`, apply retention."""
    rank = torch.distributed.get_rank()
    tmp = ck.tmp_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    dist_checkpointing.save(_state_dict(model, optimizer, is_loading=False), str(tmp))
    _barrier()
    if rank == 0:
        _fsync_tree(tmp)
        ck.write_meta(tmp, step, consumed_samples, loss, layout)
        ck.publish(root, step)
        ck.retain(root, keep_last)
    _barrier()
    return ck.step_dir(root, step)


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def choose(root: Path, resume_step: int | None) -> ck.CheckpointInfo | None:
    """The checkpoint to load: exactly `resume_step`, else the newest complete one."""
    if resume_step is None:
        return ck.newest_complete(root)
    info = ck.read_info(ck.step_dir(root, resume_step))
    if info is None or not info.complete:
        why = "missing" if info is None else info.problem
        raise FileNotFoundError(f"checkpoint for step {resume_step} in {root} unusable: {why}")
    return info


def load(model: list, optimizer: object, info: ck.CheckpointInfo) -> Loaded:
    """Load model and optimizer state in place from a verified checkpoint."""
    state = dist_checkpointing.load(_state_dict(model, optimizer, is_loading=True), str(info.path))
    if len(model) == 1:
        model[0].load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model):
            chunk.load_state_dict(state[f"model{i}"])
    optimizer.load_state_dict(state["optimizer"])
    _unshare_adam_steps(optimizer)
    return Loaded(step=info.step, consumed_samples=info.consumed_samples, path=info.path)


def _unshare_adam_steps(optimizer: object) -> None:
    """Give each parameter its own Adam `step` tensor.

    Loading the distributed optimizer state leaves one shared `step` tensor for all params;
    torch Adam increments it once per param per step, so bias correction would go wrong and
    the resumed losses would silently differ from an uninterrupted run.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt in chained:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for st in inner.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()


def elapsed(t0: float) -> float:
    return time.perf_counter() - t0
