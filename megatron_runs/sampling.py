"""Deterministic data order: which global sample indices a step consumes (pure, torch-free).

A *global sample index* g = 0, 1, 2, … numbers samples in consumption order over all epochs;
skip ranges, poison windows and `consumed_samples` all speak in these indices. The run keeps a
cursor (the next g to consume, saved as `consumed_samples` in every checkpoint); a step takes
the next `global_batch` indices at or after the cursor that no skip range covers. Without skips
step s therefore consumes [s·B, (s+1)·B): a pure function of (seed, step, global batch). A
resumed run with skips consumes exactly what a clean run with those skips would.

g maps to a dataset sample through a per-epoch permutation seeded by (seed, epoch), so the
order is shuffled but reproducible, and independent of the parallel layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SkipRanges = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class StepSamples:
    """The global indices one step consumes and the cursor after it."""

    indices: tuple[int, ...]
    next_cursor: int
    skipped: int


def normalize_skips(skips: SkipRanges) -> list[tuple[int, int]]:
    """Sort and merge half-open ranges; drop empty ones."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((int(s), int(e)) for s, e in skips if e > s):
        if start < 0:
            raise ValueError(f"skip range ({start}, {end}) starts below 0")
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def take_step(cursor: int, global_batch: int, skips: SkipRanges) -> StepSamples:
    """Take `global_batch` indices from `cursor` on, stepping over merged skip ranges."""
    ranges = normalize_skips(skips)
    out: list[int] = []
    g, skipped = cursor, 0
    while len(out) < global_batch:
        hit = next(((s, e) for s, e in ranges if s <= g < e), None)
        if hit is not None:
            skipped += hit[1] - g
            g = hit[1]
            continue
        nxt = min((s for s, _ in ranges if s > g), default=None)
        stop = g + (global_batch - len(out))
        if nxt is not None:
            stop = min(stop, nxt)
        out.extend(range(g, stop))
        g = stop
    return StepSamples(tuple(out), g, skipped)


def rank_slice(indices: Sequence[int], dp_rank: int, dp_size: int) -> list[int]:
    """The contiguous share of a step's indices that one data-parallel rank consumes.

    Depends on the DP rank only, never on the TP/PP rank: every rank of a tensor-parallel
    group must see the same tokens, or replicated parameters drift apart.
    """
    if len(indices) % dp_size:
        raise ValueError(f"global batch {len(indices)} not divisible by data parallel {dp_size}")
    per = len(indices) // dp_size
    return list(indices[dp_rank * per : (dp_rank + 1) * per])


def dataset_index(g: int, num_samples: int, seed: int) -> int:
    """Map a global sample index to a sample of the dataset via a per-epoch permutation."""
    epoch, pos = divmod(g, num_samples)
    perm = _permutation(seed, epoch, num_samples)
    return int(perm[pos])


_PERM_CACHE: dict[tuple[int, int, int], np.ndarray] = {}


def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    key = (seed, epoch, n)
    perm = _PERM_CACHE.get(key)
    if perm is None:
        if len(_PERM_CACHE) > 4:
            _PERM_CACHE.clear()
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        _PERM_CACHE[key] = perm
    return perm
