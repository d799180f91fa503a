"""OpenAPI examples: a small spec that validates, and one whose layout cannot run."""

from typing import Any

TINY_SPEC: dict[str, Any] = {
    "name": "tiny-cpu",
    "model": {
        "num_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 64,
        "vocab_size": 4096,
        "precision": "fp32",
    },
    "parallelism": {"tensor": 2, "pipeline": 2, "data": 1, "distributed_optimizer": False},
    "resources": {"device": "cpu", "nodes": 1, "gpus_per_node": 4, "time_limit_minutes": 30},
    "training": {"train_steps": 120, "micro_batch_size": 2, "global_batch_size": 8},
    "checkpoint": {"interval_steps": 20, "keep_last": 3},
}

TOO_BIG_SPEC: dict[str, Any] = {
    "name": "llama-8b-one-gpu",
    "model": {
        "num_layers": 48,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "ffn_hidden_size": 9728,
        "seq_length": 2048,
        "vocab_size": 32000,
        "activation": "swiglu",
        "normalization": "RMSNorm",
        "position_embedding": "rope",
        "untie_embeddings": True,
    },
    "resources": {"nodes": 1, "gpus_per_node": 1, "gpu_memory_gib": 80},
    "training": {"train_steps": 1000, "micro_batch_size": 8, "global_batch_size": 8},
}

SPEC_EXAMPLES: dict[str, Any] = {
    "tiny": {"summary": "Tiny GPT, TP 2 × PP 2 on 4 CPU processes", "value": TINY_SPEC},
    "too_big": {"summary": "8B on one 80 GB GPU (does not fit)", "value": TOO_BIG_SPEC},
}
