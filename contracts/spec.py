"""RunSpec: the one document that describes a training run.

It is the contract between the REST API, the launcher, the worker and the training program,
so it is plain pydantic with no I/O. Unknown keys are rejected everywhere (a typo in a CI
spec must fail loudly, not silently fall back to a default). Layout checks that need several
sections at once (world size, divisibility, memory) live in `supervisor.layout`, which imports
this module and never the other way round.
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from contracts.slurm_names import (
    MAX_EXCLUDED_NODES,
    MAX_HOSTLIST_CHARS,
    NODE_NAME_PATTERN,
    SLURM_NAME_PATTERN,
    expand_nodes,
)

# Upper bounds keep every number storable in a 64-bit column and every estimate finite; they are
# far beyond any real run, so they only ever reject garbage (e.g. a fuzzer's 10**40 layers).
_MAX_INT = 2**40
PositiveInt = Annotated[int, Field(gt=0, le=_MAX_INT)]
NonNegativeInt = Annotated[int, Field(ge=0, le=_MAX_INT)]
#: Partition, account, QOS: they become `#SBATCH` lines (`contracts.slurm_names`).
SlurmName = Annotated[str, Field(pattern=SLURM_NAME_PATTERN)]
NodeName = Annotated[str, Field(pattern=NODE_NAME_PATTERN)]
HostlistExpression = Annotated[
    str, Field(min_length=1, max_length=MAX_HOSTLIST_CHARS, pattern=r"^[A-Za-z0-9_.,\[\]-]+$")
]
MAX_PATH_CHARS = 4096
MAX_FAULTS = 64


def _clean_path(value: str) -> str:
    """Shape only (no filesystem here): absolute, printable, no `..`, normalised. Where the
    path may point is the server's business (`supervisor.roots`)."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError("a path may not hold NUL or control characters")
    if not value.startswith("/"):
        raise ValueError("must be an absolute path")
    if ".." in value.split("/"):
        raise ValueError("a path may not hold '..' components")
    return "/" + posixpath.normpath(value).lstrip("/")  # normpath keeps a leading "//"


SpecPath = Annotated[
    str, Field(min_length=1, max_length=MAX_PATH_CHARS), AfterValidator(_clean_path)
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    """GPT shape. Llama-style (RMSNorm, SwiGLU, RoPE, GQA) and GPT-2-style options."""

    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_query_groups: PositiveInt | None = Field(
        default=None, description="KV groups for GQA; None means one per head (MHA)."
    )
    ffn_hidden_size: PositiveInt | None = Field(default=None, description="Default 4 × hidden.")
    seq_length: PositiveInt
    vocab_size: PositiveInt = Field(description="Padded vocabulary size of the tokenizer.")
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    activation: Literal["gelu", "swiglu"] = "gelu"
    position_embedding: Literal["learned_absolute", "rope"] = "learned_absolute"
    untie_embeddings: bool = False
    precision: Literal["bf16", "fp32"] = "bf16"

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def kv_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


class ParallelismSpec(_Strict):
    """Megatron-Core 3D layout. world size = tensor × pipeline × data."""

    tensor: PositiveInt = 1
    pipeline: PositiveInt = 1
    data: PositiveInt = 1
    virtual_pipeline: PositiveInt | None = Field(
        default=None, description="Model chunks per pipeline stage (interleaved schedule)."
    )
    sequence_parallel: bool = False
    distributed_optimizer: bool = True

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data


class ResourcesSpec(_Strict):
    """What to ask SLURM for.

    `device` decides where the ranks train, never the supervisor's host: `gpu` (the default)
    asks SLURM for `gpus_per_node` GPUs on every node and a rank that finds fewer stops at once
    (exit 78); `cpu` trains on CPU ranks with gloo, `gpus_per_node` of them per node, and hides
    any GPU the node has.
    """

    device: Literal["gpu", "cpu"] = "gpu"
    nodes: PositiveInt = 1
    spare_nodes: NonNegativeInt = Field(
        default=0,
        le=64,
        description="Extra nodes the job holds idle: a node fault swaps the bad node for one "
        "inside the running job, with no queue wait (needs recovery.restart_in_job).",
    )
    gpus_per_node: PositiveInt = Field(
        default=1, description="GPUs per node (device gpu); ranks per node (device cpu)."
    )
    gpu_memory_gib: float = Field(default=80.0, gt=0, le=1e6)
    cpus_per_task: PositiveInt = Field(default=1, description="CPU cores per rank.")
    memory_gib: PositiveInt | None = Field(
        default=None,
        le=1 << 20,
        description="Host memory per node (sbatch --mem); None: the partition's default.",
    )
    exclusive: bool = Field(default=False, description="Whole nodes only (sbatch --exclusive).")
    partition: SlurmName | None = None
    account: SlurmName | None = None
    qos: SlurmName | None = None
    time_limit_minutes: PositiveInt = Field(
        default=24 * 60, description="Walltime of one attempt; longer runs chain attempts."
    )
    exclude: list[HostlistExpression] = Field(
        default_factory=list,
        max_length=MAX_EXCLUDED_NODES,
        description="Node names or SLURM hostlist expressions (`n[01-04]`); stored expanded.",
    )

    @field_validator("exclude")
    @classmethod
    def _expand_exclude(cls, value: list[str]) -> list[str]:
        return expand_nodes(value)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


class TrainingSpec(_Strict):
    train_steps: PositiveInt
    micro_batch_size: PositiveInt = 1
    global_batch_size: PositiveInt = 1
    lr: float = Field(default=3e-4, gt=0)
    min_lr: float = Field(default=3e-5, ge=0)
    lr_warmup_steps: NonNegativeInt = 0
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(default=0.1, ge=0)
    adam_beta1: float = Field(default=0.9, gt=0, lt=1)
    adam_beta2: float = Field(default=0.95, gt=0, lt=1)
    clip_grad: float = Field(default=1.0, ge=0)
    seed: int = Field(default=1234, ge=0, le=2**32 - 1)
    log_interval: PositiveInt = 1
    recompute: Literal["none", "selective", "full"] = Field(
        default="none",
        description="Activation recomputation: selective recomputes core attention, full every "
        "layer's activations from its input (Megatron-Core's recompute_granularity).",
    )
    replica_check_every: NonNegativeInt = Field(
        default=10,
        description="Steps between replica checksums (parameters that must be bit-identical "
        "across data- and tensor-parallel ranks); 0 turns them off.",
    )
    token_budget: PositiveInt | None = Field(
        default=None, description="Optional total tokens; the layout report gives steps for it."
    )
    eval_interval: NonNegativeInt = Field(
        default=0,
        description="Steps between validation-loss evaluations on data.split's valid share "
        "(forward only, no update, no training sample consumed); 0 turns them off.",
    )
    eval_iters: PositiveInt = Field(
        default=10,
        le=100_000,
        description="Global batches per evaluation: the first eval_iters × global_batch_size "
        "samples of the valid split, the same set every time.",
    )

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> TrainingSpec:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self


MAX_BLEND_PARTS = 256
_SPLIT_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*,\s*[0-9]+(\.[0-9]+)?\s*$"


class BlendPart(_Strict):
    """One Megatron indexed dataset of a blend and its share of the samples."""

    prefix: SpecPath
    weight: float = Field(gt=0, le=1e9, description="Relative; the blend normalises them.")


class DataSpec(_Strict):
    """Megatron indexed dataset(s) (`<prefix>.bin/.idx`) plus the tokenizer that made them.

    One `prefix`, or a `blend` of several with weights (Megatron-Core's BlendedDataset), not
    both; neither means the built-in demo corpus prepared on first use under NIGHTWATCH_HOME.
    `split` "train,valid" (e.g. "98,2") holds the valid share of every dataset's documents
    out of training, for the validation loss (`training.eval_interval`).
    """

    prefix: SpecPath | None = None
    blend: list[BlendPart] | None = Field(default=None, min_length=1, max_length=MAX_BLEND_PARTS)
    split: str | None = Field(
        default=None,
        pattern=_SPLIT_PATTERN,
        description='"train,valid" weights of each dataset\'s documents, e.g. "98,2"; '
        "None: every document trains.",
    )
    tokenizer: SpecPath | None = Field(default=None, description="tokenizer.json of the dataset.")

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if self.prefix is not None and self.blend is not None:
            raise ValueError("give data.prefix or data.blend, not both")
        if self.split is not None and self.split_fractions[0] <= 0:
            raise ValueError(f"data.split {self.split!r} must give training a share above 0")
        return self

    @property
    def split_fractions(self) -> tuple[float, float]:
        """(train, valid), normalised; (1, 0) without a split."""
        if self.split is None:
            return 1.0, 0.0
        train, valid = (float(x) for x in self.split.split(","))
        total = train + valid
        return (train / total, valid / total) if total > 0 else (0.0, 0.0)

    @property
    def megatron(self) -> bool:
        """Whether the data goes through Megatron-Core's GPTDataset / BlendedDataset; a plain
        prefix (or the demo corpus) without a split reads `megatron_runs.data.TokenStream`."""
        return self.blend is not None or self.split is not None


class CheckpointSpec(_Strict):
    interval_steps: PositiveInt = 100
    keep_last: PositiveInt = 3
    keep_seconds: float = Field(
        default=120.0,
        ge=0,
        description="Also keep every checkpoint saved within this many seconds of the newest: "
        "a rollback needs one from before a fault the watchdog saw seconds later, which "
        "keep_last alone rotates out when steps are fast.",
    )
    dir: SpecPath | None = Field(
        default=None, description="Default: $NIGHTWATCH_HOME/runs/<run id>/checkpoints."
    )
    async_save: bool = False
    in_memory: bool = Field(
        default=True,
        description="With recovery.restart_in_job, also keep each rank's state at its newest "
        "save in host memory that outlives the rank (twice the rank's state), so a restart "
        "inside the job loads from RAM when every rank holds the checkpoint it resumes from; "
        "disk stays the durable tier.",
    )
    interval_auto: bool = Field(
        default=False,
        description="Save every sqrt(2 × save cost × MTBF) of training (Young/Daly), from the "
        "loop's measured stall per save and the run's observed fault rate (mtbf_hours until "
        "it has one), within [interval_min_steps, interval_max_steps]; interval_steps until "
        "the first save is measured.",
    )
    interval_min_steps: PositiveInt = 10
    interval_max_steps: PositiveInt = 5000
    mtbf_hours: float = Field(
        default=24.0, gt=0, description="Mean time between failures assumed before any fault."
    )

    @model_validator(mode="after")
    def _interval_bounds(self) -> CheckpointSpec:
        if self.interval_min_steps > self.interval_max_steps:
            raise ValueError(
                f"interval_min_steps ({self.interval_min_steps}) must not exceed "
                f"interval_max_steps ({self.interval_max_steps})"
            )
        return self


class RecoverySpec(_Strict):
    """Detector thresholds and remedy budgets. Defaults follow ../shared/DOMAIN.md."""

    loss_spike_window: PositiveInt = Field(default=50, description="Trailing steps for median/MAD.")
    loss_spike_mad_factor: float = Field(default=8.0, gt=0)
    loss_spike_ratio: float = Field(
        default=2.0, gt=1, description="Also require loss > r × median."
    )
    loss_spike_sustain_steps: PositiveInt = 3
    loss_spike_hard_factor: float = Field(
        default=10.0,
        gt=1,
        description="Loss > factor × max of the trailing window is a spike without sustain "
        "(Megatron's rule): a 1-2 step spike must not slip under the sustain window.",
    )
    grad_norm_max: float = Field(default=10.0, gt=0, description="Sustained norm above → alarm.")
    nan_attribution_wait_seconds: float = Field(
        default=5.0,
        ge=0,
        description="How long NaN gradients with a finite loss wait for the nodes' own "
        "counters to name the node that made them (at least one scrape interval).",
    )
    throughput_drop_ratio: float = Field(default=0.5, gt=0, lt=1)
    straggler_ratio: float = Field(default=1.5, gt=1, description="Node step time / median.")
    straggler_steps: int = Field(
        default=16,
        ge=2,
        le=10_000,
        description="The trainer names a straggler: a node whose step time (its slowest "
        "rank's time before the step's all-reduce) was above straggler_ratio × the median "
        "of the other nodes' in more than half of the last this many steps, or above twice "
        "the others' in each of the last third of them (a severe straggler).",
    )
    hang_factor: float = Field(default=10.0, gt=1, description="× median step time.")
    hang_floor_seconds: float = Field(default=60.0, gt=0)
    hang_gap_factor: float = Field(
        default=3.0,
        gt=1,
        description="The hang limit is also at least this × the longest gap between two "
        "steps the run has shown (saves, evaluations, stalls under load: "
        "nightwatch_train_step_gap_max_seconds): a pause the run has already come through "
        "is not a hang, as nvidia-resiliency-ext sizes its heartbeat timeouts.",
    )
    save_hang_seconds: float = Field(
        default=600.0,
        gt=0,
        description="While the training loop waits on a save (the trainer exports when it "
        "began: nightwatch_train_save_started_timestamp_seconds), no step is a hang only "
        "after this long (or the step's hang limit, if longer): a run's first synchronous "
        "save has no gap to learn from and may take minutes. A node that goes dark or "
        "whose processes exit meanwhile is still judged at the step's limit.",
    )
    checkpoint_stall_factor: float = Field(default=3.0, gt=1, description="× interval.")
    rollback_skip_steps: NonNegativeInt = Field(
        default=0,
        description="Extra steps of samples skipped after a window known only from scrapes.",
    )
    skip_margin_samples: NonNegativeInt = Field(
        default=0,
        description="Extra samples skipped after a bad window the trainer named exactly.",
    )
    skipped_updates_budget: NonNegativeInt = Field(
        default=3,
        description="Non-finite steps (update skipped) the trainer contains within "
        "skipped_updates_window_steps; one more and it stops with exit 79 naming them.",
    )
    skipped_updates_window_steps: PositiveInt = 100
    node_nonfinite_strikes: PositiveInt = Field(
        default=2,
        description="Non-finite gradients one node made (in one attempt) before it is "
        "excluded; fewer are contained.",
    )
    tolerate_spike_steps: NonNegativeInt = Field(
        default=0,
        description="A loss spike of at most this many steps that the loss recovers from is "
        "recorded, not rolled back (0: every spike the trainer flags is rolled back).",
    )
    max_restarts: NonNegativeInt = Field(
        default=5, description="Restarts that did not hold, per window, before escalating."
    )
    restart_window_minutes: PositiveInt = 30
    restart_held_steps: PositiveInt = Field(
        default=100,
        description="A restart after which the run trained this many steps past where it was "
        "decided cured its fault: it no longer counts toward the restart storm.",
    )
    eval_jump_ratio: float = Field(
        default=0.1,
        gt=0,
        le=1e6,
        description="A resumed attempt's first validation loss above (1 + ratio) × the one its "
        "checkpoint recorded (or non-finite) is an eval_jump: escalated, as the rollback did "
        "not restore the run's state (training.eval_interval).",
    )
    max_rollbacks_per_incident: PositiveInt = 2
    restart_in_job: bool = Field(
        default=True,
        description="Restart, roll back and hang remedies that indict no node restart the "
        "ranks inside the running job (no new sbatch, no queue wait); a node fault, or a job "
        "that is gone, resubmits as before.",
    )
    prepare_successor: bool = Field(
        default=True,
        description="With restart_in_job: once the ranks learn of a walltime or preemption "
        "warning, submit the next attempt's job at once (its nodes import the training "
        "program and wait), so the requeue starts it by an order instead of a cold sbatch.",
    )
    preemption_grace_seconds: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="The partition's preemption GraceTime (scontrol show partition): how "
        "long a preempted job runs between SLURM's TERM and its kill. The ranks train on "
        "through it until the next attempt's standby job is ready or the grace runs short, "
        "then save and leave, as they do through a walltime warning's lead. 0: they save and "
        "leave at once.",
    )
    restart_wait_seconds: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="How long a job whose ranks failed keeps its nodes waiting for the "
        "watchdog's restart order (restart_in_job) before it ends.",
    )
    max_excluded_nodes: NonNegativeInt = 2
    drain_excluded_nodes: bool = False
    on_escalation: Literal["cancel", "hold"] = Field(
        default="cancel",
        description="What escalation does with a job still running: cancel frees its GPUs "
        "(SLURM's TERM first, on which the trainer saves a checkpoint if its loop still "
        "runs); hold leaves it for a person to look at.",
    )


class PoisonDataFault(_Strict):
    """Samples [start, end) are garbage: NaN loss or a loss spike each time they are read."""

    kind: Literal["poison_data"] = "poison_data"
    start_sample: NonNegativeInt
    end_sample: PositiveInt
    effect: Literal["spike", "nan"] = "spike"

    @model_validator(mode="after")
    def _ordered(self) -> PoisonDataFault:
        if self.end_sample <= self.start_sample:
            raise ValueError(
                f"end_sample ({self.end_sample}) must be greater than "
                f"start_sample ({self.start_sample})"
            )
        return self


class NodeFault(_Strict):
    """A sick node: recurs until the node is excluded.

    Named (`node`, a SLURM node name or hostname), or by its place in the job (`job_node`):
    then it is the node that holds that place when the fault first strikes, and stays that
    node on every later attempt wherever the job lands (a test need not guess placement).
    """

    kind: Literal["node"] = "node"
    node: NodeName | None = None
    job_node: NonNegativeInt | None = Field(
        default=None,
        description="The job's Nth node (rank order) at the first strike; the node is then "
        "pinned for later attempts. Exactly one of node / job_node.",
    )
    effect: Literal["nan_grads", "hang", "slow", "crash"]
    after_step: NonNegativeInt = 0
    slow_factor: float = Field(default=3.0, gt=1)
    local_rank: NonNegativeInt | None = Field(
        default=None,
        description="Only this device of the node (one bad GPU); every device when unset.",
    )

    @model_validator(mode="after")
    def _one_node(self) -> NodeFault:
        if (self.node is None) == (self.job_node is None):
            raise ValueError("give exactly one of node (a node name) or job_node (a place)")
        return self


class CrashFault(_Strict):
    """One process crash at a step; does not recur after a restart."""

    kind: Literal["crash"] = "crash"
    step: PositiveInt
    rank: NonNegativeInt = 0


class CorruptCheckpointFault(_Strict):
    """Truncate the checkpoint written at this step after it is published."""

    kind: Literal["corrupt_checkpoint"] = "corrupt_checkpoint"
    step: PositiveInt


Fault = Annotated[
    PoisonDataFault | NodeFault | CrashFault | CorruptCheckpointFault,
    Field(discriminator="kind"),
]


class RunSpec(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}$")
    model: ModelSpec
    parallelism: ParallelismSpec = ParallelismSpec()
    resources: ResourcesSpec = ResourcesSpec()
    training: TrainingSpec
    data: DataSpec = DataSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    recovery: RecoverySpec = RecoverySpec()
    faults: list[Fault] = Field(
        default_factory=list, max_length=MAX_FAULTS, description="Test-only fault injection."
    )

    @model_validator(mode="after")
    def _eval_needs_valid_data(self) -> RunSpec:
        if self.training.eval_interval and self.data.split_fractions[1] <= 0:
            raise ValueError(
                'training.eval_interval needs a valid share: set data.split, e.g. "98,2"'
            )
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_text(cls, text: str) -> RunSpec:
        """Parse YAML or JSON (JSON is YAML, but its errors read better from json)."""
        stripped = text.lstrip()
        data = json.loads(text) if stripped.startswith("{") else yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError("a run spec must be a mapping at the top level")
        return cls.model_validate(data)

    @classmethod
    def from_file(cls, path: str | Path) -> RunSpec:
        return cls.from_text(Path(path).read_text())
