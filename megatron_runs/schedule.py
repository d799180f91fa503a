"""Learning-rate schedule and FLOP accounting: pure functions of the spec and the step.

The learning rate is recomputed from the step number alone (no scheduler state to save), so a
resumed run uses exactly the rates the uninterrupted run would have used.
"""

from __future__ import annotations

import math
import os

from contracts.spec import RunSpec, TrainingSpec

H100_BF16_PEAK = 989e12


def lr_at(step: int, t: TrainingSpec) -> float:
    """Linear warmup to `lr`, then decay to `min_lr` at `train_steps` (step counts from 1)."""
    if t.lr_warmup_steps and step <= t.lr_warmup_steps:
        return t.lr * step / t.lr_warmup_steps
    if t.lr_decay_style == "constant":
        return t.lr
    span = max(1, t.train_steps - t.lr_warmup_steps)
    frac = min(1.0, max(0.0, (step - t.lr_warmup_steps) / span))
    cosine = 0.5 * (1.0 + math.cos(math.pi * frac))
    coeff = 1.0 - frac if t.lr_decay_style == "linear" else cosine
    return t.min_lr + (t.lr - t.min_lr) * coeff


def parameter_count(spec: RunSpec) -> int:
    """Parameters of the GPT (embeddings included once when tied)."""
    m = spec.model
    h, f, layers, v = m.hidden_size, m.ffn, m.num_layers, m.vocab_size
    head = h // m.num_attention_heads
    qkv = h * (h + 2 * m.kv_groups * head)
    mlp = h * f * (3 if m.activation == "swiglu" else 2)
    per_layer = qkv + h * h + mlp + 4 * h
    emb = v * h * (1 if not m.untie_embeddings else 2)
    pos = m.seq_length * h if m.position_embedding == "learned_absolute" else 0
    return layers * per_layer + emb + pos + 2 * h


def flops_per_token(spec: RunSpec) -> float:
    """Training FLOPs per token: 6·N plus causal attention (6·L·s·h; half of 12·L·s·h)."""
    m = spec.model
    return 6.0 * parameter_count(spec) + 6.0 * m.num_layers * m.seq_length * m.hidden_size


def peak_flops(device: object) -> float:
    """Dense bf16 peak of one accelerator (0 on CPU: MFU is not meaningful there).

    `NIGHTWATCH_PEAK_FLOPS` overrides; H100 and H200 share the same 989 TFLOP/s.
    """
    override = os.environ.get("NIGHTWATCH_PEAK_FLOPS")
    if override:
        return float(override)
    if getattr(device, "type", "cpu") != "cuda":
        return 0.0
    return H100_BF16_PEAK
