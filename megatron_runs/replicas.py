"""Replica checksums: parameters that must be bit-identical across ranks, compared in-process.

Data-parallel replicas hold the same full parameters (the distributed optimizer all-gathers
them). Inside a tensor-parallel group, parameters that are not split (layer norms, row-parallel
biases, position embeddings) are replicated and must agree too: they drift apart when TP ranks
see different data or run non-deterministic kernels, which silently degrades the run. A bitwise
checksum per parameter is all-gathered and compared; any difference counts as a mismatch.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Order-sensitive integer checksum of a tensor's raw bits (exact, no float rounding)."""
    flat = t.detach().contiguous().view(-1)
    ints = flat.view(torch.int16 if flat.element_size() == 2 else torch.int32).to(torch.int64)
    weights = torch.arange(1, ints.numel() + 1, device=ints.device, dtype=torch.int64) % 65521
    return torch.stack([ints.sum(), (ints * weights).sum()])


def checksums(model: list, tp_replicated_only: bool) -> torch.Tensor:
    sums = []
    for chunk in model:
        for p in chunk.parameters():
            if tp_replicated_only and getattr(p, "tensor_model_parallel", False):
                continue
            sums.append(_bits(p))
    if not sums:
        return torch.zeros(2, dtype=torch.int64)
    return torch.cat(sums)


def _differs(local: torch.Tensor, group: object) -> bool:
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return False
    gathered = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(gathered, local, group=group)
    return any(not torch.equal(gathered[0], g) for g in gathered[1:])


def check(model: list, device: torch.device) -> bool:
    """Collective over all ranks: True when any DP replica or TP-replicated param differs."""
    mismatch = _differs(checksums(model, False).to(device), ps.get_data_parallel_group())
    mismatch |= _differs(checksums(model, True).to(device), ps.get_tensor_model_parallel_group())
    flag = torch.tensor([1.0 if mismatch else 0.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0)
