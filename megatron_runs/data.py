"""Token samples from a Megatron indexed dataset, in the order `sampling` prescribes.

The dataset's documents (each ending in EOD) are read as one token stream and cut into
fixed windows of seq_length + 1 tokens (inputs and shifted labels); dataset sample i starts
at token i·seq_length. Batches depend on the data-parallel rank only, so all ranks of a
tensor-parallel group build identical batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_runs.sampling import dataset_index

Poison = Callable[[int], str | None]
"""Global sample index → None, "spike" or "nan" (fault injection; see faults.py)."""


class TokenStream:
    """All tokens of an indexed dataset as one memory-mapped array, cut into windows."""

    def __init__(self, prefix: str, seq_length: int) -> None:
        index = IndexedDataset(prefix)
        dtype = np.dtype(index.index.dtype)
        self.tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
        self.seq_length = seq_length
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(f"dataset {prefix} has fewer than {seq_length + 1} tokens")

    def window(self, sample: int) -> np.ndarray:
        start = sample * self.seq_length
        return np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] float weights; poison faults change them
    position_ids: torch.Tensor  # [b, s]
    indices: list[int]


def build_microbatches(
    stream: TokenStream,
    indices: Sequence[int],
    micro_batch_size: int,
    seed: int,
    vocab_size: int,
    poison: Poison | None = None,
) -> list[MicroBatch]:
    """This rank's microbatches for one step, from its global sample indices."""
    out = []
    s = stream.seq_length
    for i in range(0, len(indices), micro_batch_size):
        chunk = list(indices[i : i + micro_batch_size])
        rows = np.stack([stream.window(dataset_index(g, stream.num_samples, seed)) for g in chunk])
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
