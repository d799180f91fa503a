"""The loop shared by both systems: follow training, inject each fault when its step comes.

A fault fires the first time the run reaches its step in any attempt (after a rollback the
same steps come again; the fault does not fire twice), whatever else is going on: faults do
not wait for each other, because the scorer tells them apart by cause, not by time
(`score.attribute`). Spec-side faults need nothing from the driver: they are recorded as
armed, and when they struck is read from the training log and the trainer's pins. An
external fault that finds nothing to act on (no job yet, the rank not running: a recovery in
progress) is tried again at the next poll, and says why when it never fired.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.soak.faults import Injector, JobView, NoTarget
from benchmarks.soak.progress import LogFollower, Progress
from benchmarks.soak.schedule import NODE_FAULTS, FaultKind, ScheduledFault, spec_fault
from benchmarks.soak.score import Injection, Remedy
from contracts.spec import NodeFault
from megatron_runs.faults import pinned_node

POLL_S = 0.5
#: torch.distributed's default collective timeout for gloo (and Megatron's
#: `distributed_timeout_minutes`): the soonest a rank stuck in a collective gives up by itself.
COLLECTIVE_TIMEOUT_S = 30 * 60.0


@dataclass
class SystemRun:
    """What one system did under the schedule (input to `score.score_system`)."""

    system: str
    submit_t: float
    end_t: float
    target_steps: int
    progress: Progress
    injections: list[Injection]
    remedies: list[Remedy] = field(default_factory=list)
    escalations: int = 0
    final_state: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def end_time(progress: Progress, target: int, fallback: float) -> float:
    """When training reached the target (the job's teardown is not training time), else the
    moment the driver gave up."""
    ev = progress.first_reaching(target)
    return ev.t if ev is not None else fallback


def is_stalled(moved_t: float, now: float, deadline: float, stall_s: float) -> bool:
    """No step for `stall_s`, and a stuck collective cannot time out before the deadline."""
    return now - moved_t >= stall_s and moved_t + COLLECTIVE_TIMEOUT_S >= deadline


def drive(
    faults: Sequence[ScheduledFault],
    follower: LogFollower,
    current_job: Callable[[], JobView],
    finished: Callable[[], str | None],
    injector: Injector,
    deadline: float,
    say: Callable[[str], None],
    stall_s: float | None = None,
) -> tuple[list[Injection], str]:
    """Run until `finished()` names a final state or the deadline passes.

    With `stall_s`, a system that made no step for that long, when no rank can time out of a
    stuck collective before the deadline, ends as "stalled": nothing it has can move it again
    within its budget, so waiting out the rest would only cost the soak's wall time (its caller
    books the rest of the budget as lost)."""
    pending = sorted(faults, key=lambda f: f.at_step)
    waiting: dict[int, str] = {}  # why a due external fault has not fired yet
    done: list[Injection] = []
    state: str | None = None
    last_step = -1
    moved_t = time.time()
    while True:
        now = time.time()
        progress = follower.poll()
        step = progress.max_step  # the furthest any attempt has reached
        if step != last_step and step % 10 == 0:
            say(f"step {step}")
        if step != last_step:
            moved_t = now
        last_step = step
        if stall_s is not None and is_stalled(moved_t, now, deadline, stall_s):
            state = "stalled"
            say(f"no step for {now - moved_t:.0f}s at step {step}: stalled until the deadline")
            break
        for fault in [f for f in pending if step >= f.at_step]:
            if fault.spec_side:
                pending.remove(fault)
                done.append(Injection(fault, None, "armed in spec"))
                say(f"{fault.kind.value} at step {fault.at_step} (in spec)")
                continue
            job = current_job()
            try:
                note = injector.inject(fault, job)
            except NoTarget as exc:
                waiting[id(fault)] = str(exc)
                continue
            except Exception as exc:  # a failed injection is a finding about the soak: record
                note = f"injection failed: {exc}"
            pending.remove(fault)
            hit = None  # a node death lands on one of the job's nodes (see Injector)
            if fault.kind is FaultKind.NODE_DEATH and injector.dead_nodes:
                hit = injector.dead_nodes[-1]
            done.append(Injection(fault, time.time(), note, hit, job.job_id))
            say(f"{fault.kind.value} at step {step}: {note}")
        for label in injector.tick(now):
            say(label)
        state = finished()
        if state is not None:
            break
        if now > deadline:
            state = "deadline"
            say("deadline reached")
            break
        time.sleep(POLL_S)
    for label in injector.finish():
        say(label)
    done.extend(Injection(f, None, _not_fired(f, last_step, waiting.get(id(f)))) for f in pending)
    return sorted(done, key=lambda i: i.fault.at_step), state


def _not_fired(fault: ScheduledFault, reached: int, why: str | None) -> str:
    if why is not None:
        return f"not injected: {why}"
    return f"not reached: the run ended at step {reached}, before step {fault.at_step}"


def with_struck_nodes(injections: Sequence[Injection], checkpoint_dir: Path) -> list[Injection]:
    """A spec-side node fault names a place in the job: the node it struck is the one the
    training program pinned beside the checkpoints (None: it never struck)."""
    return [
        replace(inj, node=pinned_node(checkpoint_dir, NodeFault(**spec_fault(inj.fault))))
        if inj.fault.spec_side and inj.fault.kind in NODE_FAULTS
        else inj
        for inj in injections
    ]
