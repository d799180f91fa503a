"""The smoke check's plan, as pure functions: the spec shrunk to a few-second run that keeps
every feature it names, what the shrink had to give up on this host, and the verdict read
from the ranks' logs.

A spec that validates can still fail at start-up (a feature combination the trainer cannot
build, a divisibility megatron asserts, a checkpoint that does not save): `shrink` keeps the
layout (TP, PP, virtual pipeline, SP), the model's kind (normalization, activation, position
embedding, tied or untied embeddings, the GQA ratio), recomputation, the distributed
optimizer, async saves and the precision, and makes everything else as small as the layout
allows, on the demo corpus (`data.prefix: null`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from contracts.spec import RunSpec

HEAD_DIM = 16
"""Head width of the shrunk model: even (RoPE rotates pairs), small enough to be quick."""
MAX_SEQ_LENGTH = 64
DEMO_VOCAB = 4096
"""The demo corpus's vocabulary (`megatron_runs.data_prep`), which the smoke run trains on."""
STEPS = 3
"""Two steps, a checkpoint, then a resumed attempt's third step (`RESUME_AT`)."""
RESUME_AT = 2
MAX_RANKS = 8
"""Ranks one host starts for a smoke run; data parallelism shrinks to 2 only within it."""

Device = Literal["cpu", "gpu"]


@dataclass(frozen=True)
class SmokePlan:
    """The run to start: its spec, where it trains, and what differs from the real run beyond
    size (each a line for the report)."""

    spec: RunSpec
    device: Device
    downgraded: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        return self.spec.parallelism.world_size


def shrink(spec: RunSpec, gpus: int = 0, max_ranks: int = MAX_RANKS) -> SmokePlan:
    """`spec` at the smallest size its features allow: on the `gpus` local GPUs when the
    spec trains on GPUs and they hold TP × PP ranks (GPUs before DP 2: bf16, NCCL and the
    fused kernels are more of the real run than a second data-parallel replica), else on at
    most `max_ranks` CPU ranks."""
    p, m = spec.parallelism, spec.model
    model_parallel = p.tensor * p.pipeline
    on_gpus = spec.resources.device == "gpu" and gpus >= model_parallel
    device: Device = "gpu" if on_gpus else "cpu"
    limit = gpus if on_gpus else max_ranks
    data = 2 if p.data > 1 and model_parallel * 2 <= limit else 1
    world = model_parallel * data
    downgraded = []
    if data == 1 and p.data > 1:
        where = f"{gpus} local GPUs" if on_gpus else f"{max_ranks} CPU ranks on one host"
        downgraded.append(
            f"parallelism.data: {p.data} → 1 (DP 2 would need {model_parallel * 2} ranks, "
            f"more than {where})"
        )
    if device == "cpu" and spec.resources.device == "gpu":
        downgraded.append(
            f"resources.device: gpu → cpu ({gpus} local GPUs for {model_parallel} model-"
            "parallel ranks): gloo instead of NCCL, no fused kernels"
        )
    if device == "cpu" and m.precision == "bf16":
        downgraded.append("model.precision: bf16 trains as fp32 on CPU ranks (the trainer's "
                          "CPU mode; megatron's bf16 module needs CUDA)")  # fmt: skip
    microbatches = p.pipeline  # the fewest a pipeline fills; the interleaved schedule's minimum
    small = spec.model_copy(
        update={
            "name": f"{spec.name[:56]}-smoke",
            "model": m.model_copy(update=_model(spec)),
            "parallelism": p.model_copy(update={"data": data}),
            "resources": spec.resources.model_copy(
                update={
                    "device": device,
                    "nodes": 1,
                    "gpus_per_node": world,
                    "cpus_per_task": 1,
                    "memory_gib": None,
                    "exclusive": False,
                    "partition": None,
                    "account": None,
                    "qos": None,
                    "time_limit_minutes": 10,
                    "exclude": [],
                }
            ),
            "training": spec.training.model_copy(
                update={
                    "train_steps": STEPS,
                    "micro_batch_size": 1,
                    "global_batch_size": microbatches * data,
                    "lr_warmup_steps": min(spec.training.lr_warmup_steps, 1),
                    "replica_check_every": min(spec.training.replica_check_every, 1),
                    # An evaluating spec evaluates every step: the forward-only schedule runs
                    # on the real layout (the split is kept, on the demo corpus).
                    "eval_interval": min(spec.training.eval_interval, 1),
                    "eval_iters": 1,
                    "token_budget": None,
                    "log_interval": 1,
                }
            ),
            "data": spec.data.model_copy(update={"prefix": None, "blend": None, "tokenizer": None}),
            "checkpoint": spec.checkpoint.model_copy(
                update={"interval_steps": RESUME_AT, "dir": None}
            ),
            "faults": [],
        }
    )
    # model_copy skips validation: a round trip makes the result a RunSpec like any other.
    return SmokePlan(RunSpec.model_validate_json(small.model_dump_json()), device, downgraded)


def _model(spec: RunSpec) -> dict[str, Any]:
    """Layers: one per model chunk. Heads: the spec's GQA ratio times one KV group per TP rank
    (two without GQA, so each rank still splits attention into heads), 16 wide. FFN: the
    spec's ratio to hidden, a multiple of TP. Sequence: 64 tokens, a multiple of TP
    (sequence parallelism splits it)."""
    p, m = spec.parallelism, spec.model
    tp = p.tensor
    ratio = m.num_attention_heads // m.kv_groups
    groups = tp * (2 if ratio == 1 else 1)
    heads = groups * ratio
    hidden = heads * HEAD_DIM
    ffn = None
    if m.ffn_hidden_size is not None:
        ffn = tp * max(1, round(hidden * m.ffn_hidden_size / m.hidden_size / tp))
    return {
        "num_layers": p.pipeline * (p.virtual_pipeline or 1),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": None if m.num_query_groups is None else groups,
        "ffn_hidden_size": ffn,
        "seq_length": tp * math.ceil(min(m.seq_length, MAX_SEQ_LENGTH) / tp),
        "vocab_size": DEMO_VOCAB,
    }


@dataclass(frozen=True)
class Phase:
    """One launch of the ranks: the flags it adds to the trainer's command line and the steps
    whose `step` lines it must log."""

    name: str
    extra_args: tuple[str, ...]
    steps: tuple[int, ...]
    resumes_from: int | None


PHASES = (
    Phase("train", ("--stop-at-step", str(RESUME_AT)), tuple(range(1, RESUME_AT + 1)), None),
    Phase("resume", (), tuple(range(RESUME_AT + 1, STEPS + 1)), RESUME_AT),
)


def phase_problems(plan: SmokePlan, phase: Phase, rank0_events: list[dict[str, Any]]) -> list[str]:
    """What rank 0's log says went wrong in a phase whose ranks all exited 0: the features
    megatron was configured with differ from the spec's, a step is missing or not finite, the
    checkpoint was not saved or not loaded."""
    p, t = plan.spec.parallelism, plan.spec.training
    out = []
    starts = [e for e in rank0_events if e["event"] == "train_start"]
    want = {
        "sequence_parallel": p.sequence_parallel,
        "recompute": t.recompute,
        "model_chunks": p.virtual_pipeline or 1,
    }
    if not starts:
        out.append("no train_start line")
    elif (got := starts[0].get("features")) != want:
        out.append(f"trained with features {got}, the spec asks for {want}")
    losses = {e["step"]: e["loss"] for e in rank0_events if e["event"] == "step"}
    for step in phase.steps:
        if step not in losses:
            out.append(f"no step {step} logged")
        elif not math.isfinite(losses[step]):
            out.append(f"step {step}: loss {losses[step]}")
    saved = {e["step"] for e in rank0_events if e["event"] == "checkpoint_saved"}
    if phase.steps[-1] not in saved:
        out.append(f"no checkpoint saved at step {phase.steps[-1]}")
    loaded = [e["step"] for e in rank0_events if e["event"] == "checkpoint_loaded"]
    if phase.resumes_from is not None and loaded != [phase.resumes_from]:
        out.append(f"expected to resume from step {phase.resumes_from}, loaded {loaded}")
    return out


def error_tail(log_text: str, max_lines: int = 30) -> list[str]:
    """The end of a failed rank's log, at most `max_lines`: its last traceback when it has one
    (torch prefixes each line with `[rank<i>]: `), the header kept and the middle elided if
    long; else its last lines."""
    lines = log_text.rstrip("\n").splitlines()
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    if not starts:
        return lines[-max_lines:]
    tail = lines[starts[-1] :]
    if len(tail) <= max_lines:
        return tail
    keep = max_lines - 2
    return [tail[0], f"… {len(tail) - 1 - keep} lines …", *tail[-keep:]]
