"""A seeded fault schedule: which fault, at which training step, with which parameters.

Pure and replayable: the same (seed, config) always gives the same schedule, and the schedule
is printed and saved before anything runs, so a failed soak can be replayed exactly. Faults
are spaced one per slot of steps so each fault's recovery is over before the next one starts
(attribution of remedies to faults is then unambiguous).

Two families: spec-side faults go into `spec.faults` and are injected by the training program
itself (tied to their cause: a data window, a sick node); external faults are done to the
running system by the soak driver (kill a rank, freeze a node, requeue, cut the walltime,
restart Prometheus / slurmctld, SIGKILL the supervisor).
"""

from __future__ import annotations

import enum
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


class FaultKind(enum.StrEnum):
    POISON_DATA = "poison_data"
    NAN_NODE = "nan_node"
    RANK_CRASH = "rank_crash"
    HANG = "hang"
    STRAGGLER = "straggler"
    NODE_DEATH = "node_death"
    PREEMPTION = "preemption"
    WALLTIME = "walltime"
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"
    PROMETHEUS_RESTART = "prometheus_restart"
    SLURMCTLD_RESTART = "slurmctld_restart"
    SUPERVISOR_KILL = "supervisor_kill"


#: Injected by the training program from `spec.faults`.
SPEC_FAULTS = frozenset(
    {FaultKind.POISON_DATA, FaultKind.NAN_NODE, FaultKind.HANG, FaultKind.STRAGGLER}
)
#: Faults that take a node out of service for good (it is excluded, or dead).
NODE_FAULTS = frozenset(
    {FaultKind.NAN_NODE, FaultKind.HANG, FaultKind.STRAGGLER, FaultKind.NODE_DEATH}
)
#: Faults that stop a job: SLURM ends it (a time limit, a preemption), some time after the
#: signal.
STOP_FAULTS = frozenset({FaultKind.WALLTIME, FaultKind.PREEMPTION})
#: Faults of the control plane's own dependencies: the right answer is no remedy at all.
INFRA_FAULTS = frozenset(
    {FaultKind.PROMETHEUS_RESTART, FaultKind.SLURMCTLD_RESTART, FaultKind.SUPERVISOR_KILL}
)
#: The remedies that cure each fault (the last remedy before recovery must be one of these;
#: empty = none may be taken). A node fault may first be tried as data/restart, then excluded.
#: Poisoned data is by its effect (`cures`): a spike is rolled back past, NaN batches within
#: the trainer's skipped-update budget are contained.
CURES: dict[FaultKind, frozenset[str]] = {
    FaultKind.POISON_DATA: frozenset({"rollback"}),
    FaultKind.NAN_NODE: frozenset({"exclude_node"}),
    FaultKind.RANK_CRASH: frozenset({"restart"}),
    FaultKind.HANG: frozenset({"exclude_node"}),
    FaultKind.STRAGGLER: frozenset({"exclude_node"}),
    FaultKind.NODE_DEATH: frozenset({"exclude_node"}),
    FaultKind.PREEMPTION: frozenset({"requeue"}),
    FaultKind.WALLTIME: frozenset({"requeue"}),
    FaultKind.CORRUPT_CHECKPOINT: frozenset({"restart"}),
    FaultKind.PROMETHEUS_RESTART: frozenset(),
    FaultKind.SLURMCTLD_RESTART: frozenset(),
    FaultKind.SUPERVISOR_KILL: frozenset(),
}
#: Kinds of the short soak (`make test`): one of each remedy family that fits in minutes.
SHORT_KINDS = (FaultKind.POISON_DATA, FaultKind.RANK_CRASH, FaultKind.NAN_NODE)


@dataclass(frozen=True)
class SoakShape:
    """The run the schedule is drawn for: steps, checkpoints, batch, nodes."""

    train_steps: int
    checkpoint_interval: int
    global_batch_size: int
    world_size: int
    nodes: tuple[str, ...]
    job_nodes: int

    def __post_init__(self) -> None:
        if self.job_nodes > len(self.nodes):
            raise ValueError(f"a job of {self.job_nodes} nodes needs more than {self.nodes}")


@dataclass(frozen=True)
class ScheduledFault:
    """One fault: what, at which step (the first time training reaches it), parameters."""

    kind: FaultKind
    at_step: int
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def spec_side(self) -> bool:
        return self.kind in SPEC_FAULTS

    def describe(self) -> str:
        detail = " ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"step {self.at_step:>5}  {self.kind.value:<19} {detail}".rstrip()


@dataclass(frozen=True)
class Schedule:
    seed: int
    shape: SoakShape
    faults: tuple[ScheduledFault, ...]

    def spec_faults(self) -> list[dict[str, Any]]:
        """`RunSpec.faults` entries (contracts.spec) for the spec-side faults."""
        return [spec_fault(f) for f in self.faults if f.spec_side]

    def render(self) -> str:
        shape = self.shape
        head = (
            f"seed {self.seed}: {len(self.faults)} faults over {shape.train_steps} steps "
            f"(checkpoint every {shape.checkpoint_interval}, nodes {','.join(shape.nodes)})"
        )
        return "\n".join([head, *(f"  {f.describe()}" for f in self.faults)])

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shape": {**asdict(self.shape), "nodes": list(self.shape.nodes)},
            "faults": [
                {"kind": f.kind.value, "at_step": f.at_step, "params": f.params}
                for f in self.faults
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        shape = SoakShape(**{**data["shape"], "nodes": tuple(data["shape"]["nodes"])})
        faults = tuple(
            ScheduledFault(FaultKind(f["kind"]), int(f["at_step"]), dict(f["params"]))
            for f in data["faults"]
        )
        return cls(int(data["seed"]), shape, faults)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def cures(fault: ScheduledFault) -> frozenset[str]:
    """The remedies that cure `fault` (CURES, with NaN batches contained)."""
    if fault.kind is FaultKind.POISON_DATA and fault.params.get("effect") == "nan":
        return frozenset({"contained"})
    return CURES[fault.kind]


def spec_fault(fault: ScheduledFault) -> dict[str, Any]:
    """The `contracts.spec` fault entry for a spec-side fault."""
    p = fault.params
    if fault.kind is FaultKind.POISON_DATA:
        return {
            "kind": "poison_data",
            "start_sample": p["start_sample"],
            "end_sample": p["end_sample"],
            "effect": p["effect"],
        }
    effect = {FaultKind.NAN_NODE: "nan_grads", FaultKind.HANG: "hang", FaultKind.STRAGGLER: "slow"}
    if fault.kind not in effect:
        raise ValueError(f"{fault.kind} is not a spec-side fault")
    out: dict[str, Any] = {
        "kind": "node",
        "job_node": p["job_node"],
        "effect": effect[fault.kind],
        "after_step": fault.at_step,
    }
    if fault.kind is FaultKind.STRAGGLER:
        out["slow_factor"] = p["slow_factor"]
    return out


def first_fault_step(shape: SoakShape) -> int:
    """Leave room for two checkpoints first: a rollback needs one saved before the onset."""
    return 2 * shape.checkpoint_interval + 1


def slots(shape: SoakShape, count: int) -> list[tuple[int, int]]:
    """`count` equal, disjoint step ranges [lo, hi) between the first fault step and the end
    (the last interval is kept free, so the run always finishes with a clean stretch)."""
    lo = first_fault_step(shape)
    hi = shape.train_steps - shape.checkpoint_interval
    if count == 0:
        return []
    width = (hi - lo) // count
    if width < 4:
        raise ValueError(
            f"{count} faults need ≥ {4 * count + lo + shape.checkpoint_interval} train steps "
            f"(have {shape.train_steps})"
        )
    return [(lo + i * width, lo + (i + 1) * width) for i in range(count)]


def draw(seed: int, shape: SoakShape, kinds: Sequence[FaultKind]) -> Schedule:
    """The schedule for `seed`: kinds in a seeded order, one per slot, seeded parameters."""
    rng = random.Random(seed)
    order = list(dict.fromkeys(kinds))
    rng.shuffle(order)
    node_faults = sum(1 for k in order if k in NODE_FAULTS)
    if len(shape.nodes) - node_faults < shape.job_nodes:
        raise ValueError(
            f"{node_faults} node faults leave fewer than {shape.job_nodes} of "
            f"{len(shape.nodes)} nodes for the job"
        )
    faults: list[ScheduledFault] = []
    for kind, (lo, hi) in zip(order, slots(shape, len(order)), strict=True):
        # Early in the slot, so the recovery fits in what is left of it.
        at = rng.randrange(lo + 1, lo + max(2, (hi - lo) // 3))
        params = _params(kind, at, shape, rng)
        if kind is FaultKind.CORRUPT_CHECKPOINT:
            at = params.pop("at_step")
        faults.append(ScheduledFault(kind, at, params))
    return Schedule(seed, shape, tuple(sorted(faults, key=lambda f: f.at_step)))


def _params(kind: FaultKind, at: int, shape: SoakShape, rng: random.Random) -> dict[str, Any]:
    if kind in NODE_FAULTS:
        # A place in the job, not a node name: where SLURM puts a restarted job is not
        # predictable (a node still completing the last job is passed over), and a fault
        # named for a node the job never lands on never strikes. The node is pinned where
        # it first strikes (`megatron_runs.faults.pin_name`; the driver for a node death).
        slot = rng.randrange(shape.job_nodes)
        if kind is FaultKind.STRAGGLER:
            return {"job_node": slot, "slow_factor": round(rng.uniform(2.5, 4.0), 2)}
        return {"job_node": slot}
    if kind is FaultKind.POISON_DATA:
        # A spike must last the detector's sustain window (RecoverySpec.loss_spike_sustain_steps,
        # 3 by default) to be one by definition; NaN is caught at the first step.
        effect = rng.choice(["spike", "nan"])
        width = rng.randint(3, 5) if effect == "spike" else rng.randint(1, 2)
        gb = shape.global_batch_size
        return {
            "start_sample": (at - 1) * gb,
            "end_sample": (at - 1 + width) * gb,
            "effect": effect,
        }
    if kind is FaultKind.RANK_CRASH:
        return {"rank": rng.randrange(shape.world_size)}
    if kind is FaultKind.CORRUPT_CHECKPOINT:
        # Right after a checkpoint is published, corrupt it, then crash a rank before the
        # next one: the restart must skip the corrupt newest checkpoint.
        interval = shape.checkpoint_interval
        ckpt = -(-at // interval) * interval
        step = ckpt + rng.randint(1, max(1, interval // 2))
        return {
            "checkpoint_step": ckpt,
            "rank": rng.randrange(shape.world_size),
            "at_step": step,
        }
    if kind is FaultKind.PROMETHEUS_RESTART:
        return {"down_s": rng.randint(10, 25)}
    if kind is FaultKind.SLURMCTLD_RESTART:
        return {"down_s": rng.randint(3, 10)}
    if kind is FaultKind.SUPERVISOR_KILL:
        return {"down_s": rng.randint(2, 8)}
    return {}


def parse_kinds(text: str | None, default: Sequence[FaultKind]) -> list[FaultKind]:
    """`--faults poison_data,rank_crash` → kinds (unknown names fail with the valid ones)."""
    if not text:
        return list(default)
    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        try:
            out.append(FaultKind(name))
        except ValueError:
            valid = ", ".join(k.value for k in FaultKind)
            raise ValueError(f"unknown fault kind {name!r}; valid: {valid}") from None
    return out
