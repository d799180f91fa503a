"""Request and response bodies of the API (the RunSpec itself lives in contracts.spec)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from supervisor.models import AttemptState, EventKind, RunState

RUN_ID_PATTERN = r"^r-[0-9a-f]{12}$"
NODE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
HOST_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9.:-]{0,254}$"
RUN_NAME_PATTERN = r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}$"
MAX_ATTEMPT = 2**31 - 1  # the largest value of a 32-bit integer column


class ProblemOut(BaseModel):
    field: str = Field(examples=["parallelism.tensor"])
    message: str = Field(examples=["48 attention heads are not divisible by tensor = 5"])
    severity: str = Field(default="error", examples=["error"])


class ErrorBody(BaseModel):
    """Every error response: a machine-readable code and a sentence for people."""

    error: str = Field(examples=["not_found"])
    message: str = Field(examples=["run r-0123456789ab not found"])
    problems: list[ProblemOut] = Field(default_factory=list)


class AttemptOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    number: int
    job_id: str | None
    executor: str
    state: AttemptState
    nodes: list[Any] = Field(validation_alias="nodes_json")
    submitted_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    exit_code: int | None
    end_reason: str | None
    resume_step: int | None
    skip_ranges: list[Any] = Field(validation_alias="skip_ranges_json")
    exclude: list[Any] = Field(validation_alias="exclude_json")


class ProgressOut(BaseModel):
    """What the watchdog last observed of the run, refreshed every tick while it trains."""

    step: int
    target_steps: int
    loss: float | None
    grad_norm: float | None
    tokens_per_second: float | None
    step_seconds: float | None = Field(description="Typical seconds per step lately.")
    eta_seconds: float | None = Field(description="Steps left × step_seconds.")
    checkpoint_step: int | None = Field(description="Newest complete checkpoint on disk.")
    ettr: float | None = Field(description="Effective training time ratio so far.")
    observed_at: float = Field(description="Unix seconds of the observation.")


class RunOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str = Field(examples=["r-3f9a0c12d4e5"])
    name: str = Field(examples=["llama-8b"])
    state: RunState
    state_reason: str | None
    cancel_requested: bool
    current_attempt: int
    target_steps: int
    last_step: int | None
    resume_step: int | None
    progress: ProgressOut | None = Field(
        default=None,
        validation_alias="progress_json",
        description="Live progress while the run trains; null before its first observed step.",
    )
    skip_ranges: list[Any] = Field(validation_alias="skip_ranges_json")
    excluded_nodes: list[Any] = Field(validation_alias="excluded_nodes_json")
    created_by: str | None = Field(description="Id of the token that submitted it.")
    owner: str = Field(description="Who may cancel it besides admin ('' for no one).")
    created_at: datetime
    updated_at: datetime
    spec: dict[str, Any] = Field(validation_alias="spec_json")


class RunDetail(RunOut):
    attempts: list[AttemptOut] = Field(default_factory=list)


class RunPage(BaseModel):
    items: list[RunOut]
    total: int = Field(description="Runs matching the filter, over all pages.")
    limit: int
    offset: int
    next_offset: int | None = Field(description="Offset of the next page; null on the last.")


class EventOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    run_id: str
    attempt: int | None
    ts: datetime
    kind: EventKind
    message: str
    data: dict[str, Any] = Field(validation_alias="data_json", description="Evidence.")


class EventPage(BaseModel):
    items: list[EventOut]
    next_after: int | None = Field(
        description="Pass as `after` to get later events; null when there are none yet."
    )


class EndpointIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field(pattern=HOST_PATTERN, examples=["10.0.0.12"])
    port: int = Field(ge=1, le=65535, examples=[9400])


class TargetGroup(BaseModel):
    """One Prometheus HTTP-SD target group."""

    targets: list[str] = Field(examples=[["10.0.0.12:9400"]])
    labels: dict[str, str] = Field(examples=[{"run_id": "r-3f9a0c12d4e5", "attempt": "1"}])


class MemoryOut(BaseModel):
    weights: float
    gradients: float
    optimizer_states: float
    activations: float
    overhead: float
    total: float
    capacity: float


class LayoutOut(BaseModel):
    """The layout report: per-GPU memory (decimal GB), batch arithmetic and problems."""

    ok: bool
    world_size: int
    requested_gpus: int
    microbatches_per_step: int
    sequences_per_step: int
    tokens_per_step: int
    steps_for_token_budget: int | None
    memory_per_gpu_gb: MemoryOut
    parameters: int
    model_states_total_gb: float
    problems: list[ProblemOut]
    sbatch: SbatchOut | None = Field(
        default=None, description="With `?render=sbatch`: what the first attempt would submit."
    )
    smoke: SmokeOut | None = Field(
        default=None,
        description="With `?smoke=true`: the smoke check's verdict (null when the layout "
        "cannot run: nothing was started).",
    )


class SmokeOut(BaseModel):
    """The spec's features trained at a tiny size on the server's host (`nightwatch validate
    --smoke` prints the same)."""

    ok: bool
    device: Literal["cpu", "gpu"]
    ranks: int
    seconds: float
    downgraded: list[str] = Field(description="What differs from the real run beyond size.")
    phase: Literal["prepare", "train", "resume"] | None = Field(
        description="The phase that failed."
    )
    error: str | None = Field(description="One line: the first failed rank and its error.")
    rank: int | None
    tail: list[str] = Field(description="The failed rank's last log lines (its traceback).")
    spec: dict[str, Any] = Field(description="The shrunk spec that was trained.")


class SbatchOut(BaseModel):
    """The first attempt's submission as the launcher would make it (nothing is submitted)."""

    run_id: str = Field(description="A stand-in for the id the run will be given.")
    parameters: dict[str, Any] = Field(description="submitit's sbatch parameters.")
    script: str = Field(description="The batch script sbatch would be given.")
    environment: dict[str, str] = Field(description="The job's environment (no secrets).")


class Health(BaseModel):
    status: str = Field(examples=["ok"])
    database: str = Field(examples=["ok"])


class LogChunkOut(BaseModel):
    run_id: str
    attempt: int
    job_id: str | None = Field(description="null until SLURM accepted the attempt's job.")
    node: str | None = Field(description="Whose log this is; null before the job exists.")
    nodes: list[str] = Field(
        description="The attempt's nodes (or `taskK` before SLURM named them)."
    )
    text: str = Field(description="Whole lines, as the task wrote them (stderr merged in).")
    offset: int = Field(description="Pass as `offset` to get what is written after this.")
    done: bool = Field(description="The attempt has ended: nothing more will be written.")


class NodeActionOut(BaseModel):
    id: int
    kind: str = Field(examples=["exclude"])
    state: str = Field(description="intent (pending), done or failed.", examples=["done"])
    requested_by: str = Field(examples=["oncall"])
    reason: str = Field(examples=["ECC errors in dmesg"])
    requested_at: datetime
    finished_at: datetime | None
    result: dict[str, Any] = Field(
        description="Restore: `undrained` (Nightwatch's drain lifted in SLURM) and `runs` "
        "(runs no longer excluding it)."
    )


class NodeIndictment(BaseModel):
    run_id: str
    attempt: int | None
    incident_id: int | None
    finding: str | None = Field(examples=["nan_grads"])
    reason: str | None
    at: datetime


class NodeOut(BaseModel):
    name: str = Field(examples=["gpu017"])
    health: str = Field(description="healthy, suspect or excluded.", examples=["excluded"])
    strikes: int = Field(description="Faults the watchdog blamed on it (kept on restore).")
    reason: str | None = Field(description="Why its health last changed.")
    since: datetime | None = Field(description="When its health last changed (null: healthy).")
    excluded: bool = Field(
        description="An operator excluded it: every run's next submission avoids it."
    )
    excluded_by: str | None
    excluded_at: datetime | None
    excluded_by_runs: list[str] = Field(
        description="Runs still going that the watchdog excluded it from."
    )
    indicted_by: list[NodeIndictment] = Field(
        description="The watchdog's exclusions that named it, oldest first."
    )
    pending: NodeActionOut | None = Field(description="An operator request not carried out yet.")


class NodeDetail(NodeOut):
    actions: list[NodeActionOut] = Field(description="Operator requests on it, newest first.")


class NodeList(BaseModel):
    items: list[NodeOut]
