"""Layout validation and the per-GPU memory estimate, as pure functions over a RunSpec.

Everything that needs several spec sections at once lives here, so a layout that cannot run is
rejected before anything reaches SLURM, with the field and the numbers in the message. The
memory model is the one in ../shared/DOMAIN.md: 16 B of model state per parameter (bf16
weights + grads, fp32 master weights + Adam moments) split over tensor × pipeline (optimizer
states further over data with the distributed optimizer), plus activations ≈ c·L·B·S·h·2 B.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from contracts.spec import RunSpec

GB = 1e9
GIB = 2**30
ACTIVATION_FACTOR = 3.0
"""c in c·L·B·S·h·2 B: activation bytes per layer per token per hidden unit (DOMAIN.md)."""
OVERHEAD_BYTES = 10 * GB
"""CUDA context, workspaces, fragmentation: the low end of DOMAIN.md's 10–20 GB."""

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

    @property
    def total_bytes(self) -> float:
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.activations_bytes
            + self.overhead_bytes
        )

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
    m = spec.model
    h = m.hidden_size
    kv_dim = h * m.kv_groups // m.num_attention_heads
    attention = 2 * h * h + 2 * h * kv_dim
    mlp = (3 if m.activation == "swiglu" else 2) * h * m.ffn
    per_layer = attention + mlp + 2 * h
    embeddings = m.vocab_size * h * (2 if m.untie_embeddings else 1)
    if m.position_embedding == "learned_absolute":
        embeddings += m.seq_length * h
    return m.num_layers * per_layer + embeddings + h


def memory_estimate(spec: RunSpec) -> MemoryEstimate:
    """Per-GPU bytes of the busiest pipeline stage under `spec.parallelism`."""
    p = spec.parallelism
    m = spec.model
    n = parameter_count(spec)
    weight_bytes = 2 if m.precision == "bf16" else 4
    optimizer_bytes = 16 - 2 * weight_bytes
    model_parallel = p.tensor * p.pipeline
    per_gpu = n / model_parallel
    optimizer = per_gpu * optimizer_bytes
    if p.distributed_optimizer:
        optimizer /= p.data
    micro = spec.training.micro_batch_size
    in_flight = min(p.pipeline, _microbatches(spec)) if p.pipeline > 1 else 1
    layers_per_stage = m.num_layers / p.pipeline
    activations = (
        ACTIVATION_FACTOR
        * layers_per_stage
        * max(in_flight, 1)
        * micro
        * m.seq_length
        * m.hidden_size
        * 2
        / p.tensor
    )
    return MemoryEstimate(
        parameters=n,
        model_states_total_bytes=16.0 * n,
        weights_bytes=per_gpu * weight_bytes,
        gradients_bytes=per_gpu * weight_bytes,
        optimizer_bytes=optimizer,
        activations_bytes=activations,
        overhead_bytes=OVERHEAD_BYTES,
        capacity_bytes=spec.resources.gpu_memory_gib * GIB,
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
            f"activations {m.activations_bytes / GB:.1f} + overhead {m.overhead_bytes / GB:.1f}) "
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
