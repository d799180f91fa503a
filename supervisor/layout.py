"""Layout validation and the per-GPU memory estimate, as pure functions over a RunSpec.

Everything that needs several spec sections at once lives here, so a layout that cannot run is
rejected before anything reaches SLURM, with the field and the numbers in the message.

The memory model is measured, not guessed (docs/benchmarks.md, "Memory model"; the recorded
peaks are in docs/data/ and `tests/control/test_layout.py` holds the model to them):
* model states of the busiest pipeline stage, split over tensor parallelism: bf16 weights
  (2 B/param), fp32 gradient buffers (4 B/param: Megatron's DDP accumulates main grads in
  fp32), and the optimizer (fp32 master weights + Adam moments, 12 B/param; 8 B in fp32
  training), split over data parallelism with the distributed optimizer;
* activations per layer per token after Korthikanti et al. (2022) with flash attention (no
  s² term): layer-norm inputs, attention and MLP tensors saved for backward, per the model's
  hidden, KV and FFN widths; tensor parallelism splits all but ~10·h bytes of them (all of them
  with sequence parallelism); the first pipeline stage holds min(pp, microbatches)
  microbatches in flight under 1F1B (pp + (pp − 1)/v with v interleaved model chunks per rank,
  Korthikanti et al.; not yet measured), the last one microbatch plus the fp32 logits;
* PyTorch's caching allocator reserves up to 10 % beyond what is allocated (25 % with full
  recomputation), and the CUDA
  context, NCCL and cuBLAS workspaces take about 8–9 GB beyond that (10 GB budgeted).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from contracts.spec import RunSpec

GB = 1e9
GIB = 2**30
OVERHEAD_BYTES = 10 * GB
"""CUDA context, NCCL buffers, cuBLAS workspaces: measured 8.1–9.3 GB beyond PyTorch's pool."""
FRAGMENTATION = 0.10
"""Reserved over allocated bytes in PyTorch's caching allocator: measured 0.3–10 %."""
FRAGMENTATION_FULL_RECOMPUTE = 0.25
"""The same with full recomputation, whose per-layer re-forward churns the cache: 15–25 %."""
GRADIENT_BYTES = 4
"""Megatron's DDP keeps fp32 main-gradient buffers whatever the training precision."""

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    field: str
    message: str
    severity: Severity = "error"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU (worst stage), plus the unsharded model-state total for context."""

    parameters: int
    model_states_total_bytes: float
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    overhead_bytes: float
    capacity_bytes: float
    fragmentation: float = FRAGMENTATION

    @property
    def allocated_bytes(self) -> float:
        """What PyTorch allocates at the peak: model states and activations."""
        return (
            self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
            + self.activations_bytes
        )  # fmt: skip

    @property
    def fragmentation_bytes(self) -> float:
        return self.fragmentation * self.allocated_bytes

    @property
    def total_bytes(self) -> float:
        return self.allocated_bytes + self.fragmentation_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes


@dataclass(frozen=True)
class LayoutReport:
    world_size: int
    requested_gpus: int
    microbatches_per_step: int
    sequences_per_step: int
    tokens_per_step: int
    steps_for_token_budget: int | None
    memory: MemoryEstimate
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form used by the API and the CLI (GB are decimal, 10^9 bytes)."""
        m = self.memory
        return {
            "ok": self.ok,
            "world_size": self.world_size,
            "requested_gpus": self.requested_gpus,
            "microbatches_per_step": self.microbatches_per_step,
            "sequences_per_step": self.sequences_per_step,
            "tokens_per_step": self.tokens_per_step,
            "steps_for_token_budget": self.steps_for_token_budget,
            "memory_per_gpu_gb": {
                "weights": _gb(m.weights_bytes),
                "gradients": _gb(m.gradients_bytes),
                "optimizer_states": _gb(m.optimizer_bytes),
                "activations": _gb(m.activations_bytes),
                "fragmentation": _gb(m.fragmentation_bytes),
                "overhead": _gb(m.overhead_bytes),
                "total": _gb(m.total_bytes),
                "capacity": _gb(m.capacity_bytes),
            },
            "parameters": m.parameters,
            "model_states_total_gb": _gb(m.model_states_total_bytes),
            "problems": [asdict(p) for p in self.problems],
        }


def _gb(n: float) -> float:
    return round(n / GB, 2)


def parameter_count(spec: RunSpec) -> int:
    """Parameters of the GPT described by `spec.model` (biases ignored: < 0.1 %)."""
    return (
        spec.model.num_layers * _layer_parameters(spec)
        + _embedding_parameters(spec)
        + spec.model.hidden_size
    )


def _layer_parameters(spec: RunSpec) -> int:
    m = spec.model
    h = m.hidden_size
    kv_dim = h * m.kv_groups // m.num_attention_heads
    attention = 2 * h * h + 2 * h * kv_dim
    mlp = (3 if m.activation == "swiglu" else 2) * h * m.ffn
    return attention + mlp + 2 * h


def _embedding_parameters(spec: RunSpec) -> int:
    m = spec.model
    embeddings = m.vocab_size * m.hidden_size * (2 if m.untie_embeddings else 1)
    if m.position_embedding == "learned_absolute":
        embeddings += m.seq_length * m.hidden_size
    return embeddings


def activation_bytes_per_token(spec: RunSpec) -> float:
    """Bytes one transformer layer saves for backward per token, on one GPU (bf16 tensors)."""
    m, p = spec.model, spec.parallelism
    h, f = m.hidden_size, m.ffn
    kv_dim = h * m.kv_groups // m.num_attention_heads
    layer_norms = 4 * h  # the two norms' inputs
    attention = 2 * h + 2 * (h + 2 * kv_dim) + 2 * h + h  # QKV in; Q, K, V; out; mask
    fc1_out = 2 * f if m.activation == "swiglu" else f
    mlp = 2 * h + 2 * fc1_out + 2 * f + h  # fc1 in; activation in and out; mask
    total = layer_norms + attention + mlp
    if p.tensor == 1 or p.sequence_parallel:
        return total / p.tensor
    replicated = 10 * h  # norm inputs, QKV and fc1 inputs, masks stay whole without SP
    return replicated + (total - replicated) / p.tensor


def memory_estimate(spec: RunSpec) -> MemoryEstimate:
    """Per-GPU bytes of the busiest pipeline stage under `spec.parallelism`."""
    p, m, t = spec.parallelism, spec.model, spec.training
    weight_bytes = 2 if m.precision == "bf16" else 4
    optimizer_per_param = 12 if m.precision == "bf16" else 8
    # The first stage holds the embedding, the last the output layer: count one with the layers.
    stage = _layer_parameters(spec) * m.num_layers / p.pipeline + _embedding_parameters(spec)
    per_gpu = stage / p.tensor
    optimizer = per_gpu * optimizer_per_param
    if p.distributed_optimizer:
        optimizer /= p.data
    tokens = t.micro_batch_size * m.seq_length
    layers = m.num_layers / p.pipeline
    if t.recompute == "full":
        # Each layer keeps only its input; backward recomputes one layer at a time.
        kept = 2 * m.hidden_size / (p.tensor if p.sequence_parallel else 1)
        per_microbatch = (kept * layers + activation_bytes_per_token(spec)) * tokens
    else:  # selective recomputes core attention, whose s² term flash attention never stores
        per_microbatch = activation_bytes_per_token(spec) * tokens * layers
    logits = 2 * 4 * tokens * m.vocab_size / p.tensor  # fp32 logits and their gradient
    if p.pipeline > 1:
        # Interleaved: the first stage's warm-up runs (pp − 1)/v microbatches more.
        extra = (p.pipeline - 1) / p.virtual_pipeline if p.virtual_pipeline else 0
        in_flight = min(p.pipeline + extra, _microbatches(spec))
        activations = max(in_flight * per_microbatch, per_microbatch + logits)
    else:
        activations = per_microbatch + logits
    return MemoryEstimate(
        parameters=parameter_count(spec),
        model_states_total_bytes=(weight_bytes + GRADIENT_BYTES + optimizer_per_param)
        * parameter_count(spec),
        weights_bytes=per_gpu * weight_bytes,
        gradients_bytes=per_gpu * GRADIENT_BYTES,
        optimizer_bytes=optimizer,
        activations_bytes=activations,
        overhead_bytes=OVERHEAD_BYTES,
        capacity_bytes=spec.resources.gpu_memory_gib * GIB,
        fragmentation=FRAGMENTATION_FULL_RECOMPUTE if t.recompute == "full" else FRAGMENTATION,
    )


def _microbatches(spec: RunSpec) -> int:
    per_step = spec.training.micro_batch_size * spec.parallelism.data
    return spec.training.global_batch_size // per_step


def layout_report(spec: RunSpec) -> LayoutReport:
    """Everything an engineer wants to know about a layout before paying for the GPUs."""
    t = spec.training
    sequences = t.global_batch_size
    tokens = sequences * spec.model.seq_length
    steps = math.ceil(t.token_budget / tokens) if t.token_budget else None
    memory = memory_estimate(spec)
    return LayoutReport(
        world_size=spec.parallelism.world_size,
        requested_gpus=spec.resources.world_size,
        microbatches_per_step=_microbatches(spec),
        sequences_per_step=sequences,
        tokens_per_step=tokens,
        steps_for_token_budget=steps,
        memory=memory,
        problems=_shape_problems(spec)
        + _batch_problems(spec)
        + _memory_problems(memory)
        + _other_problems(spec),
    )


def layout_errors(spec: RunSpec) -> list[str]:
    """The blocking problems as `field: message` lines ."""
    return [f"{p.field}: {p.message}" for p in layout_report(spec).errors]


def _shape_problems(spec: RunSpec) -> list[Problem]:
    m, p, r = spec.model, spec.parallelism, spec.resources
    out: list[Problem] = []
    if r.world_size != p.world_size:
        out.append(
            Problem(
                "resources",
                f"nodes × gpus_per_node = {r.nodes} × {r.gpus_per_node} = {r.world_size} GPUs, but "
                f"tensor × pipeline × data = {p.tensor} × {p.pipeline} × {p.data} = {p.world_size}",
            )
        )
    if m.num_attention_heads % p.tensor:
        out.append(
            Problem(
                "model.num_attention_heads",
                f"{m.num_attention_heads} attention heads are not divisible by tensor = {p.tensor}",
            )
        )
    if m.vocab_size % p.tensor:
        out.append(
            Problem(
                "model.vocab_size",
                f"vocab_size {m.vocab_size} is not divisible by tensor = {p.tensor}: the "
                "vocab-parallel embedding splits it evenly (pad the vocabulary to a multiple)",
            )
        )
    if m.kv_groups % p.tensor:
        out.append(
            Problem(
                "model.num_query_groups",
                f"{m.kv_groups} KV groups are not divisible by tensor = {p.tensor}",
            )
        )
    if m.num_attention_heads % m.kv_groups:
        out.append(
            Problem(
                "model.num_query_groups",
                f"{m.num_attention_heads} attention heads are not divisible by "
                f"{m.kv_groups} KV groups",
            )
        )
    if m.hidden_size % m.num_attention_heads:
        out.append(
            Problem(
                "model.hidden_size",
                f"hidden_size {m.hidden_size} is not divisible by "
                f"{m.num_attention_heads} attention heads",
            )
        )
    if m.num_layers % p.pipeline:
        out.append(
            Problem(
                "model.num_layers",
                f"{m.num_layers} layers cannot be split evenly over pipeline = {p.pipeline} stages",
            )
        )
    if p.virtual_pipeline is not None:
        if p.pipeline == 1:
            out.append(
                Problem(
                    "parallelism.virtual_pipeline",
                    "virtual_pipeline needs pipeline > 1",
                )
            )
        elif m.num_layers % (chunks := p.pipeline * p.virtual_pipeline):
            out.append(
                Problem(
                    "parallelism.virtual_pipeline",
                    f"{m.num_layers} layers cannot be split into pipeline × virtual_pipeline = "
                    f"{p.pipeline} × {p.virtual_pipeline} = {chunks} chunks",
                )
            )
    if p.tensor > r.gpus_per_node:
        out.append(
            Problem(
                "parallelism.tensor",
                f"tensor = {p.tensor} spans nodes (gpus_per_node = {r.gpus_per_node}); "
                "tensor parallelism across nodes is slow",
                "warning",
            )
        )
    if p.sequence_parallel and p.tensor == 1:
        out.append(
            Problem(
                "parallelism.sequence_parallel",
                "sequence_parallel has no effect with tensor = 1",
                "warning",
            )
        )
    if p.sequence_parallel and m.seq_length % p.tensor:
        out.append(
            Problem(
                "parallelism.sequence_parallel",
                f"seq_length {m.seq_length} is not divisible by tensor {p.tensor}: sequence "
                "parallelism splits each sequence over the tensor-parallel ranks",
            )
        )
    return out


def _batch_problems(spec: RunSpec) -> list[Problem]:
    t, p = spec.training, spec.parallelism
    per_step = t.micro_batch_size * p.data
    if t.global_batch_size % per_step:
        return [
            Problem(
                "training.global_batch_size",
                f"global_batch_size {t.global_batch_size} is not divisible by micro_batch_size × "
                f"data = {t.micro_batch_size} × {p.data} = {per_step}",
            )
        ]
    out: list[Problem] = []
    micro = t.global_batch_size // per_step
    if p.pipeline > 1 and micro < p.pipeline:
        out.append(
            Problem(
                "training.global_batch_size",
                f"{micro} microbatches per step < pipeline = {p.pipeline}: the pipeline idles "
                f"(raise global_batch_size to ≥ {p.pipeline * per_step})",
                "warning",
            )
        )
    if p.virtual_pipeline is not None and p.pipeline > 1 and micro % p.pipeline:
        out.append(
            Problem(
                "training.global_batch_size",
                f"the interleaved schedule needs microbatches ({micro}) divisible by "
                f"pipeline = {p.pipeline}",
            )
        )
    return out


def _memory_problems(m: MemoryEstimate) -> list[Problem]:
    if m.fits:
        return []
    return [
        Problem(
            "resources.gpu_memory_gib",
            f"estimated {m.total_bytes / GB:.1f} GB per GPU (weights {m.weights_bytes / GB:.1f} + "
            f"gradients {m.gradients_bytes / GB:.1f} + optimizer {m.optimizer_bytes / GB:.1f} + "
            f"activations {m.activations_bytes / GB:.1f} + fragmentation "
            f"{m.fragmentation_bytes / GB:.1f} + overhead {m.overhead_bytes / GB:.1f}) "
            f"exceeds {m.capacity_bytes / GB:.1f} GB ({m.capacity_bytes / GIB:g} GiB); "
            "add tensor/pipeline parallelism or lower micro_batch_size",
        )
    ]


def _other_problems(spec: RunSpec) -> list[Problem]:
    out: list[Problem] = []
    t, r = spec.training, spec.resources
    if len(set(r.exclude)) != len(r.exclude):
        out.append(Problem("resources.exclude", "resources.exclude lists a node twice"))
    if any(not name.strip() for name in r.exclude):
        out.append(Problem("resources.exclude", "resources.exclude has an empty node name"))
    if r.spare_nodes and not spec.recovery.restart_in_job:
        out.append(
            Problem(
                "resources.spare_nodes",
                "spare_nodes needs recovery.restart_in_job: a spare is used inside the job",
            )
        )
    if t.lr_warmup_steps > t.train_steps:
        out.append(
            Problem(
                "training.lr_warmup_steps",
                f"lr_warmup_steps {t.lr_warmup_steps} exceeds train_steps {t.train_steps}",
            )
        )
    if spec.checkpoint.interval_steps > t.train_steps:
        out.append(
            Problem(
                "checkpoint.interval_steps",
                f"interval_steps {spec.checkpoint.interval_steps} > train_steps {t.train_steps}: "
                "only the final checkpoint will be written",
                "warning",
            )
        )
    world = spec.parallelism.world_size
    total_samples = t.train_steps * t.global_batch_size
    for i, fault in enumerate(spec.faults):
        where = f"faults[{i}]"
        if fault.kind == "crash" and fault.rank >= world:
            out.append(Problem(f"{where}.rank", f"rank {fault.rank} ≥ world size {world}"))
        elif fault.kind == "crash" and fault.step > t.train_steps:
            out.append(
                Problem(
                    f"{where}.step", f"step {fault.step} > train_steps {t.train_steps}", "warning"
                )
            )
        elif fault.kind == "poison_data" and fault.start_sample >= total_samples:
            out.append(
                Problem(
                    f"{where}.start_sample",
                    f"start_sample {fault.start_sample} is never read "
                    f"(train_steps × global_batch_size = {total_samples})",
                    "warning",
                )
            )
        elif fault.kind == "node" and fault.node is not None and fault.node in r.exclude:
            out.append(
                Problem(f"{where}.node", f"node {fault.node} is already excluded", "warning")
            )
        elif fault.kind == "node" and fault.job_node is not None and fault.job_node >= r.nodes:
            out.append(
                Problem(
                    f"{where}.job_node", f"job_node {fault.job_node} ≥ the job's {r.nodes} nodes"
                )
            )
    return out
