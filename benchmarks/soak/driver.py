"""The loop shared by both systems: follow training, inject each fault when its step comes.

A fault fires the first time training reaches its step (after a rollback the same steps come
again; the fault does not fire twice). Spec-side faults need nothing from the driver: they are
recorded as armed, and their time is read from the training log when scored. An external fault
also waits until the previous fault has settled (`min_gap_s`, longer after a walltime cut, a
preemption or a service outage): two faults in one window could not be told apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.soak.faults import Injector, JobView
from benchmarks.soak.progress import LogFollower, Progress
from benchmarks.soak.schedule import NODE_FAULTS, FaultKind, ScheduledFault, spec_fault
from benchmarks.soak.score import Injection, Remedy
from megatron_runs.faults import pinned_node
from supervisor.spec import NodeFault

POLL_S = 0.5
MIN_GAP_S = 30.0
#: How long some external faults take to show or to end (measured on the devcluster): a cut
#: walltime is enforced by slurmctld's periodic limit check, then USR2, a checkpoint and exit
#: (63 s seen, with up to a minute more left since `WALLTIME_LEFT_MIN` is 2); a preemption has
#: its 30 s grace.
SETTLE_S = {FaultKind.WALLTIME: 180.0, FaultKind.PREEMPTION: 45.0}
#: torch.distributed's default collective timeout for gloo (and Megatron's
#: `distributed_timeout_minutes`): the soonest a rank stuck in a collective gives up by itself.
COLLECTIVE_TIMEOUT_S = 30 * 60.0


def settle_s(fault: ScheduledFault, min_gap_s: float) -> float:
    """Seconds the next external fault waits after this one."""
    outage = float(fault.params.get("down_s", 0.0))
    return max(min_gap_s + outage, SETTLE_S.get(fault.kind, 0.0))


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


def _gives_way_to(pending: Sequence[ScheduledFault], step: int) -> ScheduledFault | None:
    """The next spec-side fault, when `pending[0]`, due at `step`, was held back so long that
    less than half of its scheduled distance to it is left (the schedule spaces faults on
    purpose; an on-time fault keeps its distance whatever the step time)."""
    spec = next((f for f in pending[1:] if f.spec_side), None)
    if spec is not None and spec.at_step - step < (spec.at_step - pending[0].at_step) / 2:
        return spec
    return None


def drive(
    faults: Sequence[ScheduledFault],
    follower: LogFollower,
    current_job: Callable[[], JobView],
    finished: Callable[[], str | None],
    injector: Injector,
    deadline: float,
    say: Callable[[str], None],
    min_gap_s: float = MIN_GAP_S,
    stall_s: float | None = None,
) -> tuple[list[Injection], str]:
    """Run until `finished()` names a final state or the deadline passes.

    With `stall_s`, a system that made no step for that long, when no rank can time out of a
    stuck collective before the deadline, ends as "stalled": nothing it has can move it again
    within its budget, so waiting out the rest would only cost the soak's wall time (its caller
    books the rest of the budget as lost)."""
    pending = list(faults)
    done: list[Injection] = []
    state: str | None = None
    last_step = -1
    moved_t = time.time()
    next_allowed = 0.0
    while True:
        now = time.time()
        progress = follower.poll()
        step = progress.max_step
        if step != last_step and step % 10 == 0:
            say(f"step {step}")
        if step != last_step:
            moved_t = now
        last_step = step
        if stall_s is not None and is_stalled(moved_t, now, deadline, stall_s):
            state = "stalled"
            say(f"no step for {now - moved_t:.0f}s at step {step}: stalled until the deadline")
            break
        while pending and step >= pending[0].at_step:
            fault = pending[0]
            if fault.spec_side:
                pending.pop(0)
                next_allowed = max(next_allowed, now + min_gap_s)
                done.append(Injection(fault, None, "armed in spec"))
                say(f"{fault.kind.value} at step {fault.at_step} (in spec)")
                continue
            if now < next_allowed:
                break
            spec = _gives_way_to(pending, step)
            if spec is not None:
                # A delayed external fault would land on the spec-side one after it (their
                # remedies would share a window): let the spec-side fault go first.
                held = pending.pop(0)
                pending.insert(pending.index(spec) + 1, held)
                break
            pending.pop(0)
            try:
                note = injector.inject(fault, current_job())
            except Exception as exc:  # a failed injection is a finding about the soak: record
                note = f"injection failed: {exc}"
            fired = time.time()
            next_allowed = fired + settle_s(fault, min_gap_s)
            hit = None  # a node death lands on one of the job's nodes (see Injector)
            if fault.kind is FaultKind.NODE_DEATH and injector.dead_nodes:
                hit = injector.dead_nodes[-1]
            done.append(Injection(fault, fired, note, hit))
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
    done.extend(Injection(f, None, "not reached") for f in pending)
    return done, state


def with_struck_nodes(injections: Sequence[Injection], checkpoint_dir: Path) -> list[Injection]:
    """A spec-side node fault names a place in the job: the node it struck is the one the
    training program pinned beside the checkpoints (None: it never struck)."""
    return [
        replace(inj, node=pinned_node(checkpoint_dir, NodeFault(**spec_fault(inj.fault))))
        if inj.fault.spec_side and inj.fault.kind in NODE_FAULTS
        else inj
        for inj in injections
    ]
