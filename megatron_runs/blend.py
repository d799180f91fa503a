"""Samples from Megatron-Core's GPTDataset / BlendedDataset: `data.blend`, `data.split`.

Megatron's `BlendedMegatronDatasetBuilder` builds the train and valid splits of the blend (its
document shuffle, sample index and blending index, with its compiled helpers). The train split
is built for the run's `train_steps × global_batch_size` samples, so global sample index g
reads train[g mod len(train)]: a pure function of (seed, the data section, train_steps ×
global batch, g), none of which change within a run. Skip ranges, poison windows and the
`consumed_samples` cursor speak in g as with `TokenStream` (`megatron_runs.sampling`), so a
rolled-back run with skips trains like a clean run skipping the same samples, and a resume
is exact. Only a cursor that skips pushed past the run's samples wraps round to the start of
the same order.

The valid split is built for `eval_iters × global_batch_size` samples: one fixed set, read
from the start at every evaluation, so validation curves compare.

Every rank builds the indices itself, in memory, before the process group exists. Megatron's
index cache does not fit our fault model: it writes its .npy files in place (no temporary
file and rename) and counts a cache as hit when the files exist, so a rank killed while
writing (a crash, a preemption) leaves a truncated index that every later attempt loads; with
a process group it builds on global rank 0 and has every other rank load rank 0's files, so
the cache must be shared; and by default it writes beside the dataset, which is often
read-only or shared between runs. A private temporary cache, removed once built, avoids all
three; the cost is measured in docs/benchmarks.md.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from contracts.spec import RunSpec


class _NoTokenizer:
    """What GPTDatasetConfig reads of a tokenizer when no mask is derived from EOD: no vocab
    size (the .idx file's dtype decides how tokens are read) and no pad token."""

    vocab_size = None
    eod = None

    @property
    def unique_identifiers(self) -> dict[str, str]:
        """Megatron names a dataset's cached indices by a hash of its config, tokenizer too."""
        return {"class": "NoTokenizer"}


@dataclass
class MegatronSplit:
    """One split of Megatron's datasets as a `megatron_runs.data.Source`: index g reads
    dataset[g mod len(dataset)]."""

    seq_length: int
    dataset: object

    def row(self, g: int) -> np.ndarray:
        return _tokens(self.dataset[g % len(self.dataset)])


def _tokens(sample: dict) -> np.ndarray:
    """GPTDataset's inputs and labels back into the seq_length + 1 tokens they were cut from."""
    return np.concatenate([sample["tokens"].numpy(), sample["labels"][-1:].numpy()])


def _every_split_has_documents(
    prefixes: list[str], split_matrix: list[tuple[float, float] | None], split: str | None
) -> None:
    """Megatron cuts each dataset's documents at round(bound × count); a split left without
    documents has no tokens, and GPTDataset then counts epochs forever. Refuse it, named."""
    for prefix in prefixes:
        count = len(IndexedDataset(prefix))
        for name, bounds in zip(("train", "valid"), split_matrix, strict=False):
            if bounds is None:
                continue
            docs = round(bounds[1] * count) - round(bounds[0] * count)
            if docs < 1:
                raise ValueError(
                    f"data.split {split!r} leaves the {name} split of {prefix} without documents "
                    f"(it has {count}): give that split a larger share"
                )


def build(
    spec: RunSpec, demo_prefix: str | None = None
) -> tuple[MegatronSplit, MegatronSplit | None]:
    """The spec's blend (or single prefix, or `demo_prefix`): its train split, and its valid
    split (None without a valid share)."""
    data, t = spec.data, spec.training
    if data.blend is not None:
        prefixes = [p.prefix for p in data.blend]
        weights = [p.weight for p in data.blend] if len(prefixes) > 1 else None
    else:
        prefix = data.prefix or demo_prefix
        if prefix is None:
            raise ValueError("no data prefix")
        prefixes, weights = [prefix], None
    train, valid = data.split_fractions
    batch = t.global_batch_size
    with tempfile.TemporaryDirectory(prefix="nightwatch-data-") as cache:
        config = GPTDatasetConfig(
            random_seed=t.seed,
            sequence_length=spec.model.seq_length,
            blend=(prefixes, weights),
            split=f"{train},{valid},0",
            path_to_cache=cache,
            tokenizer=_NoTokenizer(),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
        )
        sizes = [t.train_steps * batch, t.eval_iters * batch if valid > 0 else 0, 0]
        _every_split_has_documents(prefixes, config.split_matrix, data.split)
        splits = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    seq = spec.model.seq_length
    return MegatronSplit(seq, splits[0]), MegatronSplit(seq, splits[1]) if valid > 0 else None
