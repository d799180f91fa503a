"""Shared helpers of the training tests (a unique module name: tests/ has no packages)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 4096


def spec_dict(
    name: str,
    tp: int = 2,
    pp: int = 2,
    dp: int = 1,
    steps: int = 8,
    interval: int = 4,
    faults: list[dict] | None = None,
    layers: int = 4,
) -> dict:
    """A tiny GPT (4 layers, hidden 64, seq 64) on the demo corpus, global batch 8."""
    return {
        "name": name,
        "model": {
            "num_layers": layers,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "seq_length": 64,
            "vocab_size": VOCAB,
            "precision": "fp32",
        },
        "parallelism": {"tensor": tp, "pipeline": pp, "data": dp},
        "resources": {"device": "cpu", "nodes": 1, "gpus_per_node": tp * pp * dp},
        "training": {
            "train_steps": steps,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "lr": 0.003,
            "min_lr": 0.0003,
            "lr_warmup_steps": 2,
        },
        "checkpoint": {"interval_steps": interval, "keep_last": 3},
        "faults": faults or [],
    }


def halves(source: str, out: Path) -> list[str]:
    """The demo corpus's documents split by parity into two indexed datasets."""
    from megatron_runs.cpu_compat import stub_triton_kernels

    stub_triton_kernels()  # importing megatron.core needs it where triton is absent
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    ds = IndexedDataset(source)
    prefixes = []
    for part in (0, 1):
        prefix = str(out / f"half{part}")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=ds.index.dtype)
        for i in range(part, len(ds), 2):
            doc = np.asarray(ds[i])
            builder.add_document(doc, [len(doc)])
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    return prefixes
