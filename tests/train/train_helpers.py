"""Shared helpers of the training tests (a unique module name: tests/ has no packages)."""

from __future__ import annotations

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
