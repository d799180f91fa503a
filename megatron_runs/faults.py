"""Fault injection, driven only by the spec's `faults` section (test use).

Each fault is tied to its cause, so only the right remedy cures it:
* poison_data: samples [start, end) turn into garbage (loss spike) or NaN loss each time they
  are read — it recurs until a rollback skips those global sample indices;
* node: a sick node (by node name) yields NaN gradients, hangs, runs slow, or crashes on every
  step from `after_step` on — it recurs on every attempt until the node is excluded; with
  `local_rank`, only that device of the node does (one bad GPU); one given by its place in the
  job (`job_node`) is whichever node holds that place at the first strike, pinned by a marker
  file from then on, so it is met again only where a later attempt lands on that node;
* crash: one process crash at a step; a marker file beside the checkpoints records that it
  fired, so a restart (whatever its attempt number, under any supervisor) does not meet it again;
* corrupt_checkpoint: the checkpoint published at that step is truncated, once (marker likewise).

The loop holds one `Faults` and calls it at fixed points of every step: `before_step` (crash,
hang), `poison_effect` (as the batch is built), `poison_grads` (inside the grad-finalize hook,
before reduction), `straggle` (after the optimizer step) and, on rank 0, `corrupt_after_publish`
(after a save). `Faults()`, what a spec without faults gets, does nothing at any of them.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from contracts import exitcodes
from contracts.spec import CorruptCheckpointFault, CrashFault, NodeFault, PoisonDataFault, RunSpec


@dataclass
class Faults:
    """The faults that apply to this process (node already resolved); none by default."""

    poison: tuple[PoisonDataFault, ...] = ()
    node: tuple[NodeFault, ...] = ()
    crash: tuple[CrashFault, ...] = ()
    corrupt: tuple[CorruptCheckpointFault, ...] = ()
    marker_dir: Path | None = None
    this_node: str = ""
    #: Pin files of this process's `job_node` faults not pinned yet: written at the first strike.
    to_pin: set[str] = field(default_factory=set)
    #: The step being computed (set by `before_step`), for the hook inside Megatron's schedule.
    step: int = 0

    @classmethod
    def for_process(
        cls,
        spec: RunSpec,
        node: str,
        rank: int,
        checkpoint_dir: Path,
        local_rank: int = 0,
        job_nodes: Sequence[str] = (),
    ) -> Faults:
        """Faults of this process; one-shot faults that already fired (marker present) drop out.

        `job_nodes` (the job's nodes in rank order) places the `job_node` faults not pinned yet.
        """
        fs = spec.faults
        if not fs:
            return cls()
        markers = Path(checkpoint_dir) / ".faults"
        sick: list[NodeFault] = []
        to_pin: set[str] = set()
        for f in fs:
            if not isinstance(f, NodeFault) or f.local_rank not in (None, local_rank):
                continue
            where = f.node if f.node is not None else pinned_node(checkpoint_dir, f)
            unpinned = False
            if where is None and f.job_node is not None and f.job_node < len(job_nodes):
                where, unpinned = job_nodes[f.job_node], True
            if where == node:
                sick.append(f)
                if unpinned:
                    to_pin.add(pin_name(f))
        return cls(
            poison=tuple(f for f in fs if isinstance(f, PoisonDataFault)),
            node=tuple(sick),
            crash=tuple(
                f
                for f in fs
                if isinstance(f, CrashFault)
                and f.rank == rank
                and not (markers / _crash_marker(f)).exists()
            ),
            corrupt=tuple(
                f
                for f in fs
                if isinstance(f, CorruptCheckpointFault)
                and not (markers / _corrupt_marker(f)).exists()
            ),
            marker_dir=markers,
            this_node=node,
            to_pin=to_pin,
        )

    def _mark_fired(self, name: str) -> None:
        if self.marker_dir is not None:
            self.marker_dir.mkdir(parents=True, exist_ok=True)
            (self.marker_dir / name).touch()

    def poison_effect(self, sample: int) -> str | None:
        """ "spike" / "nan" when a poisoned window covers this global sample index."""
        for f in self.poison:
            if f.start_sample <= sample < f.end_sample:
                return f.effect
        return None

    def node_effects(self, step: int) -> set[str]:
        active = [f for f in self.node if step >= f.after_step]
        if self.to_pin:  # only until the first strike: not a string per fault on every step
            for f in active:
                if pin_name(f) in self.to_pin:
                    self._pin(f, step)
        return {f.effect for f in active}

    def _pin(self, fault: NodeFault, step: int) -> None:
        """Record this node as the `job_node` fault's node (first writer wins, atomically)."""
        self.to_pin.discard(pin_name(fault))
        if self.marker_dir is None:
            return
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        final = self.marker_dir / pin_name(fault)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
        tmp.write_text(self.this_node)
        try:
            os.link(tmp, final)
        except FileExistsError:
            return  # another rank of this node pinned it first
        finally:
            tmp.unlink()
        pinned = {"node": self.this_node, "job_node": fault.job_node, "effect": fault.effect}
        sys.stderr.write(_event_line("node_fault_pinned", step, **pinned))
        sys.stderr.flush()

    def slow_factor(self) -> float:
        return max((f.slow_factor for f in self.node if f.effect == "slow"), default=1.0)

    def before_step(self, step: int) -> None:
        """Crash or hang here when a fault says so (called at the start of each step)."""
        self.step = step
        effects = self.node_effects(step)
        for f in self.crash:
            if f.step == step:
                self._mark_fired(_crash_marker(f))
        if any(f.step == step for f in self.crash) or "crash" in effects:
            sys.stderr.write(_event_line("injected_crash", step))  # one write
            sys.stderr.flush()
            os._exit(exitcodes.INJECTED_CRASH)
        if "hang" in effects:
            sys.stderr.write(_event_line("injected_hang", step))
            sys.stderr.flush()
            while True:
                time.sleep(3600)

    def slow_delay(self, step: int, busy_seconds: float) -> float:
        """Extra seconds a slow node spends on this step (its step takes × slow_factor)."""
        if "slow" not in self.node_effects(step):
            return 0.0
        return (self.slow_factor() - 1.0) * busy_seconds

    def straggle(self, step: int, busy_seconds: float) -> float:
        """Sleep the slow node's extra time for this step (`slow_delay`); return it."""
        delay = self.slow_delay(step, busy_seconds)
        if delay:
            time.sleep(delay)
        return delay

    def nan_grads(self, step: int) -> bool:
        return "nan_grads" in self.node_effects(step)

    def poison_grads(self, model: Sequence) -> None:
        """A sick node's NaN gradients: written into the DDP grad buffers of `model` before
        they are reduced, on the step `before_step` began."""
        if self.nan_grads(self.step):
            for chunk in model:
                for buf in chunk.buffers:
                    buf.grad_data.view(-1)[0] = math.nan

    def corrupt_after_publish(self, step: int, ckpt: Path) -> Path | None:
        """Truncate the largest file of the checkpoint of `step`; return it if done."""
        fired = [f for f in self.corrupt if f.step == step]
        if not fired:
            return None
        self._mark_fired(_corrupt_marker(fired[0]))
        return truncate_largest(Path(ckpt))


def truncate_largest(ckpt: Path) -> Path | None:
    """What a torn write looks like: the largest data file of a checkpoint cut to half."""
    files = [p for p in ckpt.rglob("*") if p.is_file() and p.name != "nightwatch.json"]
    if not files:
        return None
    victim = max(files, key=lambda p: p.stat().st_size)
    with victim.open("r+b") as fh:
        fh.truncate(victim.stat().st_size // 2)
    return victim


def pin_name(fault: NodeFault) -> str:
    """The marker file that pins a `job_node` fault to the node it first struck."""
    device = "" if fault.local_rank is None else f"-device{fault.local_rank}"
    return f"node-job{fault.job_node}-{fault.effect}-after{fault.after_step}{device}.pin"


def pinned_node(checkpoint_dir: Path, fault: NodeFault) -> str | None:
    """The node a `job_node` fault struck first (None: not yet, or a fault named by node)."""
    if fault.job_node is None:
        return None
    try:
        return (Path(checkpoint_dir) / ".faults" / pin_name(fault)).read_text().strip() or None
    except OSError:
        return None


def _crash_marker(fault: CrashFault) -> str:
    return f"crash-step{fault.step}-rank{fault.rank}.fired"


def _corrupt_marker(fault: CorruptCheckpointFault) -> str:
    return f"corrupt-step{fault.step}.fired"


def _event_line(event: str, step: int, **fields: object) -> str:
    """An event line in the trainer's format (`contracts.logs.json_records` reads it), written
    here directly: the rank may exit or hang right after it."""
    line = {"ts": round(time.time(), 3), "event": event, **fields, "step": step}
    return json.dumps(line) + "\n"
