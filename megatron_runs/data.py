"""Token samples in the order `sampling` prescribes, and the microbatches built from them.

A `Source` maps a global sample index g to one sample: seq_length + 1 tokens (inputs and
shifted labels). `TokenStream` reads one Megatron indexed dataset as one token stream cut into
fixed windows (dataset sample i starts at token i·seq_length), through `sampling`'s per-epoch
permutation; `megatron_runs.blend` reads Megatron-Core's GPTDataset / BlendedDataset (a blend,
a train/valid split). Batches depend on the data-parallel rank only, so all ranks of a
tensor-parallel group build identical batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_runs.sampling import dataset_index

Poison = Callable[[int], str | None]
"""Global sample index → None, "spike" or "nan" (fault injection; see faults.py)."""


class Source(Protocol):
    """Where a step's samples come from: global sample index → seq_length + 1 tokens."""

    seq_length: int

    def row(self, g: int) -> np.ndarray: ...


class TokenStream:
    """All tokens of an indexed dataset as one memory-mapped array, cut into windows."""

    def __init__(self, prefix: str, seq_length: int, seed: int) -> None:
        index = IndexedDataset(prefix)
        dtype = np.dtype(index.index.dtype)
        self.tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(f"dataset {prefix} has fewer than {seq_length + 1} tokens")

    def window(self, sample: int) -> np.ndarray:
        start = sample * self.seq_length
        return np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)

    def row(self, g: int) -> np.ndarray:
        return self.window(dataset_index(g, self.num_samples, self.seed))


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] float weights; poison faults change them
    position_ids: torch.Tensor  # [b, s]
    indices: list[int]


def build_microbatches(
    source: Source,
    indices: Sequence[int],
    micro_batch_size: int,
    seed: int,
    vocab_size: int,
    poison: Poison | None = None,
) -> list[MicroBatch]:
    """This rank's microbatches for one step, from its global sample indices."""
    out = []
    s = source.seq_length
    for i in range(0, len(indices), micro_batch_size):
        chunk = list(indices[i : i + micro_batch_size])
        rows = np.stack([source.row(g) for g in chunk])
        weights = np.ones((len(chunk), s), dtype=np.float32)
        for row, g in enumerate(chunk):
            effect = poison(g) if poison else None
            if effect == "spike":
                # Garbage tokens, weighted up: a loss spike that comes from the data itself.
                rng = np.random.default_rng([seed, g, 7])
                rows[row] = rng.integers(0, vocab_size, size=s + 1)
                weights[row] = 20.0
            elif effect == "nan":
                weights[row] = np.nan
        t = torch.from_numpy(rows)
        out.append(
            MicroBatch(
                tokens=t[:, :-1].contiguous(),
                labels=t[:, 1:].contiguous(),
                loss_mask=torch.from_numpy(weights),
                position_ids=torch.arange(s).unsqueeze(0).expand(len(chunk), s).contiguous(),
                indices=chunk,
            )
        )
    return out


def to_device(batches: list[MicroBatch], device: torch.device) -> Iterator[MicroBatch]:
    for b in batches:
        yield MicroBatch(
            tokens=b.tokens.to(device, non_blocking=True),
            labels=b.labels.to(device, non_blocking=True),
            loss_mask=b.loss_mask.to(device, non_blocking=True),
            position_ids=b.position_ids.to(device, non_blocking=True),
            indices=b.indices,
        )
