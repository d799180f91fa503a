"""Score a soak (pure): per fault and per system, from ground truth plus the remedies taken.

Definitions (the same for Nightwatch and the baseline):
- fault time: when the driver injected an external fault (the first time the run reached its
  step, in any attempt); for poisoned data, when the first step that trained a poisoned
  sample began (from the trainer's data cursor and the skips its group trained with: a window
  an earlier skip covered never strikes); for a node fault, the first time a process group
  on the node it struck (the trainer's pin) began its step or a later one.
- cause: each remedy is matched to the fault it cures by what it names, never by when it
  came. A remedy records the finding that caused it (`finding_kind`), the job it acted on,
  the nodes it excluded or blamed and the samples it skipped; a fault matches when the
  finding is one its kind causes (`CAUSES`) and the remedy names its place: a poisoned
  window's samples, the pinned node, the job an external fault was done to. Among the faults
  that struck before a remedy, the most specific match wins (place named over place merely
  in the job over the kind alone), then the latest. So two faults in one recovery, or a
  rollback to before a fault scheduled later, are scored each on its own. A remedy that
  records no cause (the baseline's requeues) goes to the latest fault that struck before it.
- detected: some remedy was matched; detection latency: its first remedy − fault time.
- cured by: the last remedy matched; right action: it is one of `schedule.cures(fault)`
  (infra faults: no remedy at all is the right action), and an exclusion names the faulty node.
  A fault the trainer contained (its updates skipped, no action) is cured by `contained`: the
  supervisor's incident for it, which names its samples or node. A time limit cut or a
  preemption whose job the run left (another fault's remedy started the next attempt in
  another job, the successor prepared for the stop) before it struck is cured by `moved`
  (`left_by`), with no recovery time of its own.
- recovered: (contained) a good step after the fault; else a process group that started after
  the last remedy trained a good step past its resume step (the first such group: a cure
  placed on the next fault's node recovers with the group after that fault's cure);
  MTTR = that moment − fault time.
- steps lost: for each restart that a matched remedy caused, the step the previous group had
  reached minus the step the restart resumed from (a contained fault causes none).
- samples skipped (poisoned data): the samples the matched remedies skipped, against the
  window plus the spec's margin (`skip_allowance`).
- a remedy matched to no fault is a false positive (those taken during an infra fault's
  outage are listed on it as its wrong action).
- ETTR: good steps of the final trajectory × the system's own pace / wall time (submit →
  end), i.e. the share of the wall time that was useful training; steps whose update was
  thrown away (NaN/Inf) are not good. The pace is the median time per step over windows of
  `pace_window` consecutive steps of one process group (a window holds its checkpoint save),
  so restarts, detection, replayed steps and slow stretches are what it does not count.
  `ettr_vs_reference` is the reference run's time to the same final step / wall time
  (startup costs then count as useful); it also holds any drift in the machine's speed
  between the two runs, which the own pace does not (a clean soak on the 2-core VM scored
  118.6 % by it: its reference, minutes later, stepped 25 % slower).
  `ettr_vs_reference_paced` takes that drift out: the reference's time converted to this
  run's pace (× this run's pace / the reference's, both as above) / wall time, so the
  reference's own start-up, saves and steps count as useful, at the speed this run had.
  The machine's speed also moves within a run (a CPU step took 0.08-0.115 s from one
  1,000-step stretch to the next of one soak), which one pace for the run counts as time lost
  or won: `ettr_vs_reference_local` cuts both runs at the faults' steps into stretches, takes
  each stretch's time beyond its steps at its own pace (`excess_s`), and charges this run
  with what its stretches lost beyond the reference's: 1 − (excess − the reference's) / wall.
- loss: every step of the final trajectory against the exact reference's (`reference.py`:
  it sees the same samples and applies the same updates), equal bit for bit or not;
  `final_loss` is the last step's, `loss_rel_diff` only says how far apart they are.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.soak.progress import Progress, StartEvent, StepEvent, final_trajectory, time_to_step
from benchmarks.soak.reference import Skips, compare_losses, normalized
from benchmarks.soak.schedule import (
    INFRA_FAULTS,
    NODE_FAULTS,
    STOP_FAULTS,
    FaultKind,
    ScheduledFault,
    cures,
)

_NUMERIC = frozenset({"nonfinite", "loss_spike", "grad_explosion"})
_JOB_ENDED = frozenset({"job_failed", "job_lost", "hang"})
#: The findings (`supervisor.watchdog.snapshot.FindingKind`) each fault kind can cause. A
#: crashed rank fails the job, or leaves its peers waiting in a collective (a hang the
#: exited node vouches for); a dead node is a NODE_FAIL or a hang its dark host explains.
CAUSES: dict[FaultKind, frozenset[str]] = {
    FaultKind.POISON_DATA: _NUMERIC,
    FaultKind.NAN_NODE: _NUMERIC,
    FaultKind.RANK_CRASH: _JOB_ENDED,
    FaultKind.CORRUPT_CHECKPOINT: _JOB_ENDED,
    FaultKind.HANG: frozenset({"hang"}),
    FaultKind.STRAGGLER: frozenset({"straggler", "throughput_drop", "hang"}),
    FaultKind.NODE_DEATH: _JOB_ENDED | {"job_node_fail"},
    FaultKind.PREEMPTION: frozenset({"job_preempted"}),
    FaultKind.WALLTIME: frozenset({"job_timeout", "job_preempted", "job_ended_early"}),
}
#: How long after an infra fault's outage a remedy is still its doing (a tick or a scrape).
INFRA_GRACE_S = 30.0


@dataclass(frozen=True)
class Remedy:
    """One remedy a system took: Nightwatch's recorded action, or a baseline restart."""

    t: float
    kind: str
    nodes: tuple[str, ...] = ()  # what an exclusion named
    cause: str | None = None  # the finding kind it remedied (None: the system records none)
    job_id: str | None = None  # the job it acted on
    skips: Skips = ()  # the sample ranges a rollback skipped
    finding_nodes: tuple[str, ...] = ()  # the nodes the finding blamed
    attempt_nodes: tuple[str, ...] = ()  # the nodes of the job it acted on
    moved_to: str | None = None  # the job its next attempt started in (None: not recorded)


@dataclass(frozen=True)
class Injection:
    """A scheduled fault as it happened: when it was injected (None: not triggered)."""

    fault: ScheduledFault
    t: float | None
    note: str = ""
    node: str | None = None  # the node a node fault hit (its schedule names a place in the job)
    job_id: str | None = None  # the job an external fault was done to


@dataclass(frozen=True)
class FaultScore:
    kind: str
    at_step: int
    fault_t: float | None
    triggered: bool
    remedies: list[str]
    detected: bool
    detection_latency_s: float | None
    cured_by: str | None
    right_action: bool
    recovered: bool
    mttr_s: float | None
    steps_lost: int
    note: str = ""
    samples_skipped: int = 0
    #: The most a remedy may skip for it: a poisoned window's size plus the spec's margin.
    skip_allowance: int = 0


@dataclass(frozen=True)
class SystemScore:
    system: str
    wall_s: float
    final_step: int
    target_steps: int
    reached_target: bool
    good_steps: int
    bad_steps_kept: int
    ettr: float | None
    ettr_vs_reference: float | None
    final_loss: float | None
    reference_loss: float | None
    loss_rel_diff: float | None
    remedies: int
    escalations: int
    false_positives: int
    unrecovered: int
    faults: list[FaultScore] = field(default_factory=list)
    loss_equal: bool | None = None  # None: no reference
    loss_steps_compared: int = 0
    loss_steps_unequal: int = 0
    #: (step, this system's loss, the reference's) for the first steps that differ
    loss_mismatches: list[tuple[int, float | None, float | None]] = field(default_factory=list)
    #: The reference's time at this system's pace / wall time (None: no reference).
    ettr_vs_reference_paced: float | None = None
    #: 1 − (the time its stretches lost beyond the reference's, each at its own pace) / wall.
    ettr_vs_reference_local: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_began(progress: Progress, event: StepEvent) -> float:
    """When `event`'s step began: the previous step's end in its process group, else its
    group's start."""
    earlier = [
        e.t for e in progress.steps if e.incarnation == event.incarnation and e.t < event.t
    ] + [s.t for s in progress.starts if s.incarnation == event.incarnation and s.t <= event.t]
    return max(earlier, default=event.t)


def _cursor_before(progress: Progress, event: StepEvent) -> int | None:
    prior = [e for e in progress.steps if e.incarnation == event.incarnation and e.t < event.t]
    if prior:
        return prior[-1].consumed
    start = next((s for s in progress.starts if s.incarnation == event.incarnation), None)
    return start.cursor if start is not None else None


def _trains(lo: int, hi: int, window: tuple[int, int], skips: Skips) -> bool:
    """Does a step that moved the cursor from `lo` to `hi` train a sample of `window`?"""
    a, b = max(lo, window[0]), min(hi, window[1])
    covered = sum(max(0, min(b, e) - max(a, s)) for s, e in skips)
    return b > a and covered < b - a


def first_poisoned_step(progress: Progress, window: tuple[int, int]) -> StepEvent | None:
    """The first step (in time) that trained a sample of `window`; None: no step did."""
    skips = {s.incarnation: s.skips for s in progress.starts}
    for ev in progress.steps:
        lo = _cursor_before(progress, ev)
        if (
            lo is not None
            and ev.consumed is not None
            and _trains(lo, ev.consumed, window, skips.get(ev.incarnation, ()))
        ):
            return ev
    return None


def fault_time(inj: Injection, progress: Progress) -> float | None:
    """External faults: injection time; spec-side faults: start of the faulty step.

    A node fault strikes the node that holds its place in the job when training first reaches
    its step; the training program pins that node (`Injection.node`; None: it never struck).
    A NaN node's time is the start of the first step at or past it whose update the trainer
    threw away; a hang's or a straggler's, the start of the first such step that a process
    group on the pinned node began (a later restart may land elsewhere first). Poisoned data
    strikes at the first step that trains one of its samples (an older log without the data
    cursor: the first time training reached its step)."""
    fault = inj.fault
    if not fault.spec_side:
        return inj.t
    if fault.kind in NODE_FAULTS and inj.node is None:
        return None  # no node was pinned: it never struck
    if fault.kind is FaultKind.NAN_NODE:
        first = next((e for e in progress.steps if e.step >= fault.at_step and e.bad), None)
        return step_began(progress, first) if first is not None else None
    if inj.node is not None:
        return _first_step_on(progress, inj.node, fault.at_step)
    cursors = any(e.consumed is not None for e in progress.steps)
    if fault.kind is FaultKind.POISON_DATA and "start_sample" in fault.params and cursors:
        window = (int(fault.params["start_sample"]), int(fault.params["end_sample"]))
        first = first_poisoned_step(progress, window)
        return step_began(progress, first) if first is not None else None
    before = progress.first_reaching(max(0, fault.at_step - 1))
    return before.t if before is not None else None


def never_struck(inj: Injection, progress: Progress) -> str:
    """Why a fault has no time: what the run did instead."""
    fault, reached = inj.fault, progress.max_step
    if not fault.spec_side:
        return inj.note or "not injected"
    if reached < fault.at_step and fault.kind is not FaultKind.POISON_DATA:
        return f"never struck: the run never reached step {fault.at_step} (ended at {reached})"
    if fault.kind is FaultKind.POISON_DATA:
        lo, hi = fault.params.get("start_sample"), fault.params.get("end_sample")
        furthest = max((e.consumed or 0 for e in progress.steps), default=0)
        if lo is not None and furthest >= hi:
            return f"never struck: samples [{lo}, {hi}) were skipped before any step trained them"
        return f"never struck: training never reached samples [{lo}, {hi}) (cursor {furthest})"
    if fault.kind in NODE_FAULTS and inj.node is None:
        return f"never struck: no node pinned for job place {fault.params.get('job_node')}"
    return f"never struck on {inj.node}: no update thrown away at or past step {fault.at_step}"


def _first_step_on(progress: Progress, node: str, step: int) -> float | None:
    """When a process group on `node` first began a step at or past `step`."""
    for start in progress.starts:
        if node not in start.nodes:
            continue
        if start.step + 1 >= step:
            return start.t
        reached = next(
            (
                e
                for e in progress.steps
                if e.incarnation == start.incarnation and e.step >= step - 1
            ),
            None,
        )
        if reached is not None:
            return reached.t
    return None


def match_strength(inj: Injection, remedy: Remedy) -> int:
    """How specifically `remedy` names `inj` as its cause: 3 its place (samples, node, job),
    2 a job that held the faulty node, 1 the finding alone, 0 not this fault."""
    kind = inj.fault.kind
    if kind in INFRA_FAULTS:
        return 0
    if remedy.cause is None:
        return 1  # a system that records no cause: by time alone (see `attribute`)
    if remedy.cause not in CAUSES[kind]:
        return 0
    if kind is FaultKind.POISON_DATA:
        window = (inj.fault.params.get("start_sample"), inj.fault.params.get("end_sample"))
        hit = window[0] is not None and any(
            s < window[1] and window[0] < e for s, e in remedy.skips
        )
        return 3 if hit else 1
    if kind in NODE_FAULTS:
        node = inj.node
        if node is None:
            return 0
        if node in remedy.nodes or node in remedy.finding_nodes:
            return 3
        if not remedy.attempt_nodes or node in remedy.attempt_nodes:
            return 2
        return 0  # the job it acted on never ran on the faulty node
    if inj.job_id is not None and remedy.job_id is not None:
        return 3 if inj.job_id == remedy.job_id else 0
    return 1


def attribute(
    injections: Sequence[Injection], times: Sequence[float | None], remedies: Sequence[Remedy]
) -> list[int | None]:
    """For each remedy, the index of the fault it remedied (None: none, a false positive)."""
    out: list[int | None] = []
    for r in remedies:
        best: tuple[int, float, int] | None = None
        for i, (inj, t) in enumerate(zip(injections, times, strict=True)):
            if t is None or t > r.t:
                continue
            strength = match_strength(inj, r)
            if strength and (best is None or (strength, t) > best[:2]):
                best = (strength, t, i)
        out.append(best[2] if best else None)
    return out


def _outage(inj: Injection, t0: float) -> tuple[float, float]:
    return t0, t0 + float(inj.fault.params.get("down_s", 0.0)) + INFRA_GRACE_S


def skipped_for(inj: Injection, mine: Sequence[Remedy], margin: int) -> tuple[int, int]:
    """(samples the remedies matched to a poisoned window skipped, the window plus `margin`);
    (0, 0) for other faults."""
    params = inj.fault.params
    if inj.fault.kind is not FaultKind.POISON_DATA or "start_sample" not in params:
        return 0, 0
    actions = [r for r in mine if r.kind != "contained"]
    union = normalized([s for r in actions for s in r.skips])
    window = int(params["end_sample"]) - int(params["start_sample"])
    return sum(b - a for a, b in union), window + margin


def left_by(inj: Injection, t0: float | None, remedies: Sequence[Remedy]) -> Remedy | None:
    """For a fault done to a job (a time limit cut, a preemption): the first remedy after it
    that started the run's next attempt in another job, which leaves the fault nothing to
    strike (a fault during a stop moves the run to the successor prepared for the stop)."""
    if inj.fault.kind not in STOP_FAULTS or inj.job_id is None or t0 is None:
        return None
    return next(
        (
            r
            for r in remedies
            if r.t >= t0 and r.job_id == inj.job_id and r.moved_to not in (None, inj.job_id)
        ),
        None,
    )


def score_fault(
    inj: Injection,
    t0: float | None,
    mine: Sequence[Remedy],
    progress: Progress,
    skip_margin: int = 0,
    left: Remedy | None = None,
) -> FaultScore:
    """One fault, with the remedies matched to it (t0 None: it never struck; `left`: the
    remedy that moved the run off the job this fault was done to)."""
    kind = inj.fault.kind
    if t0 is None:
        return FaultScore(
            kind.value, inj.fault.at_step, None, False, [], False, None, None, False, False,
            None, 0, never_struck(inj, progress),
        )  # fmt: skip
    if not mine and left is not None:
        note = (
            f"its job {inj.job_id} was left for job {left.moved_to} by the {left.kind} "
            f"{left.t - t0:.1f} s after it, before it struck"
        )
        return FaultScore(
            kind.value, inj.fault.at_step, t0, True, [], False, None, "moved", True, True,
            None, 0, "; ".join(n for n in (inj.note, note) if n),
        )  # fmt: skip
    restarts = _restarts(progress, mine)
    lost = steps_lost(progress, restarts)
    if kind in INFRA_FAULTS:
        return FaultScore(
            kind.value, inj.fault.at_step, t0, True, [r.kind for r in mine], bool(mine), None,
            None, not mine, not mine, None, lost, inj.note,
        )  # fmt: skip
    recovered_t = None
    if mine and mine[-1].kind == "contained":
        recovered_t = next((e.t for e in progress.steps if e.t > t0 and not e.bad), None)
    elif mine:
        later = [s for s in progress.starts if s.t >= mine[-1].t]
        recovered_t = _recovery(progress, later)
    skipped, allowance = skipped_for(inj, mine, skip_margin)
    return FaultScore(
        kind=kind.value,
        at_step=inj.fault.at_step,
        fault_t=t0,
        triggered=True,
        remedies=[r.kind for r in mine],
        detected=bool(mine),
        detection_latency_s=(mine[0].t - t0) if mine else None,
        cured_by=mine[-1].kind if mine else None,
        right_action=bool(mine)
        and mine[-1].kind in cures(inj.fault)
        and _right_node(inj, mine[-1]),
        recovered=recovered_t is not None,
        mttr_s=None if recovered_t is None else recovered_t - t0,
        steps_lost=lost,
        note="; ".join(n for n in (inj.note, _contained(inj, progress, mine)) if n),
        samples_skipped=skipped,
        skip_allowance=allowance,
    )


def _contained(inj: Injection, progress: Progress, mine: Sequence[Remedy]) -> str:
    """When no remedy was taken: what the final model kept of the fault (poisoned samples it
    trained, updates the trainer threw away), so a contained or unseen fault says so."""
    if mine:
        return ""
    traj = final_trajectory(progress)
    params = inj.fault.params
    if inj.fault.kind is FaultKind.POISON_DATA and "start_sample" in params:
        window = (int(params["start_sample"]), int(params["end_sample"]))
        skips = {s.incarnation: s.skips for s in progress.starts}
        hit = [s for s in sorted(traj) if _trained_window(traj, s, window, skips)]
        skipped = [s for s in hit if traj[s].skipped_update]
        if hit:
            return (
                f"no remedy; the final model trained its samples at steps {hit} "
                f"(update skipped at {skipped})"
            )
        return ""
    bad = [s for s, e in sorted(traj.items()) if e.skipped_update and s >= inj.fault.at_step]
    return f"no remedy; skipped updates kept in the final model at steps {bad}" if bad else ""


def _trained_window(
    traj: dict[int, StepEvent], step: int, window: tuple[int, int], skips: dict[str, Skips]
) -> bool:
    """Did this step of the final trajectory train a sample of `window`?"""
    before = traj[step - 1].consumed if step - 1 in traj else 0
    ev = traj[step]
    if before is None or ev.consumed is None:
        return False
    return _trains(before, ev.consumed, window, skips.get(ev.incarnation, ()))


def _right_node(inj: Injection, cure: Remedy) -> bool:
    """An exclusion cures a node fault only when it names the faulty node."""
    node = inj.node
    return cure.kind != "exclude_node" or node is None or node in cure.nodes


def _restarts(progress: Progress, remedies: Sequence[Remedy]) -> list[StartEvent]:
    """The process group each remedy started (the first to start after it)."""
    out: list[StartEvent] = []
    for r in remedies:
        if r.kind == "contained":
            continue  # nothing was restarted
        start = next((s for s in progress.starts if s.t >= r.t), None)
        if start is not None and start not in out:
            out.append(start)
    return out


def _recovery(progress: Progress, starts: Sequence[StartEvent]) -> float | None:
    """First good step past its resume step of the first process group in `starts` that
    trains one."""
    for start in starts:
        ev = next(
            (
                e
                for e in progress.steps
                if e.incarnation == start.incarnation
                and start.t <= e.t
                and e.step > start.step
                and not e.bad
            ),
            None,
        )
        if ev is not None:
            return ev.t
    return None


def steps_lost(progress: Progress, starts: Sequence[Any]) -> int:
    """Σ over restarts: the head step before the restart minus the step it resumed from."""
    lost = 0
    for start in starts:
        head = max(
            (e.step for e in progress.steps if e.t < start.t and _latest_group(progress, e, start)),
            default=start.step,
        )
        lost += max(0, head - start.step)
    return lost


def _latest_group(progress: Progress, ev: Any, start: Any) -> bool:
    """Is `ev` from the last process group that started before `start`?"""
    before = [s for s in progress.starts if s.t < start.t]
    return bool(before) and ev.incarnation == before[-1].incarnation


def pace_s(progress: Progress, window: int) -> float | None:
    """Typical seconds per step: the median over windows of `window` consecutive steps of one
    process group (from a step to the one `window` later, so a window holds one save when
    `window` is the checkpoint interval)."""
    steps = progress.steps
    paces = [
        (b.t - a.t) / window
        for a, b in zip(steps[::window], steps[window::window], strict=False)
        if a.incarnation == b.incarnation and b.step == a.step + window
    ]
    return statistics.median(paces) if paces else None


def excess_s(progress: Progress, bounds: Sequence[int], t0: float, window: int) -> float | None:
    """Seconds lost beside the machine's drift: the run from `t0` cut at the steps `bounds`
    into stretches, each stretch's time (from the first completion of its first step to that
    of its last) beyond its steps at its own pace (`pace_s` over its steps; the whole run's
    where it holds no window), summed. None when the run never reached a bound."""
    whole = pace_s(progress, window)
    if whole is None:
        return None
    total, step, t = 0.0, 0, t0
    for bound in sorted(set(bounds)):
        reached = progress.first_reaching(bound)
        if reached is None:
            return None
        stretch = Progress(steps=[e for e in progress.steps if step < e.step <= bound])
        total += reached.t - t - (bound - step) * (pace_s(stretch, window) or whole)
        step, t = bound, reached.t
    return total


#: Mismatching steps listed in a score (the count is `loss_steps_compared` − equal ones).
MISMATCHES_SHOWN = 5


def score_system(
    system: str,
    *,
    injections: Sequence[Injection],
    progress: Progress,
    remedies: Sequence[Remedy],
    escalations: int,
    submit_t: float,
    end_t: float,
    target_steps: int,
    reference: Progress | None,
    reference_submit_t: float | None,
    emulated_steps: Sequence[int] = (),
    pace_window: int = 10,
    skip_margin: int = 0,
) -> SystemScore:
    traj = final_trajectory(progress)
    final_step = max(traj, default=0)
    good = sum(1 for e in traj.values() if not e.bad)
    bad = len(traj) - good
    times = [fault_time(i, progress) for i in injections]
    owner = attribute(injections, times, remedies)
    mine: list[list[Remedy]] = [[] for _ in injections]
    for r, i in zip(remedies, owner, strict=True):
        if i is not None:
            mine[i].append(r)
    for i, (inj, t) in enumerate(zip(injections, times, strict=True)):
        if inj.fault.kind in INFRA_FAULTS and t is not None:
            lo, hi = _outage(inj, t)
            mine[i] = [
                r for r, o in zip(remedies, owner, strict=True) if o is None and lo <= r.t < hi
            ]
    faults = [
        score_fault(inj, t, m, progress, skip_margin, left_by(inj, t, remedies))
        for inj, t, m in zip(injections, times, mine, strict=True)
    ]
    false_pos = sum(1 for o in owner if o is None)
    wall = max(1e-9, end_t - submit_t)
    pace = pace_s(progress, pace_window)
    ettr = good * pace / wall if pace else None
    ettr_ref = ettr_paced = ettr_local = None
    if reference is not None and reference_submit_t is not None and final_step:
        to_step = time_to_step(reference, final_step, reference_submit_t)
        ettr_ref = to_step / wall if to_step is not None else None
        ref_pace = pace_s(reference, pace_window)
        if to_step is not None and pace and ref_pace:
            ettr_paced = to_step * (pace / ref_pace) / wall
        cuts = [i.fault.at_step for i in injections if i.fault.at_step < final_step]
        lost = excess_s(progress, [*cuts, final_step], submit_t, pace_window)
        ref_lost = excess_s(reference, [*cuts, final_step], reference_submit_t, pace_window)
        if lost is not None and ref_lost is not None:
            ettr_local = 1 - (lost - ref_lost) / wall
    final_loss = traj[final_step].loss if final_step else None
    ref_loss, rel, equal, compared, unequal, mismatches = None, None, None, 0, 0, []
    if reference is not None:
        match = compare_losses(progress, reference, emulated_steps)
        equal, compared, unequal = match.equal, match.compared, len(match.mismatches)
        mismatches = list(match.mismatches[:MISMATCHES_SHOWN])
        ref_event = final_trajectory(reference).get(final_step)
        ref_loss = ref_event.loss if ref_event is not None else None
        if final_loss is not None and ref_loss:
            rel = abs(final_loss - ref_loss) / abs(ref_loss)
    return SystemScore(
        system=system,
        wall_s=round(wall, 1),
        final_step=final_step,
        target_steps=target_steps,
        reached_target=final_step >= target_steps,
        good_steps=good,
        bad_steps_kept=bad,
        ettr=ettr,
        ettr_vs_reference=ettr_ref,
        ettr_vs_reference_paced=ettr_paced,
        ettr_vs_reference_local=ettr_local,
        final_loss=final_loss,
        reference_loss=ref_loss,
        loss_rel_diff=rel,
        remedies=len(remedies),
        escalations=escalations,
        false_positives=false_pos,
        unrecovered=sum(
            1 for f in faults if f.triggered and not f.recovered and f.kind not in _INFRA
        ),
        faults=faults,
        loss_equal=equal,
        loss_steps_compared=compared,
        loss_steps_unequal=unequal,
        loss_mismatches=mismatches,
    )


_INFRA = {k.value for k in INFRA_FAULTS}


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, spec or ".1f")
    return str(value)


def fault_table(scores: Sequence[SystemScore]) -> str:
    """Per fault, one column group per system: detected / remedy / latency / MTTR / lost."""
    if not scores:
        return ""
    header = f"{'fault':<19} {'step':>5} |" + "|".join(f" {s.system:<44}" for s in scores)
    sub = f"{'':<19} {'':>5} |" + "|".join(
        f" {'det':>3} {'last remedy':<18} {'lat s':>6} {'MTTR s':>6} {'lost':>5} " for _ in scores
    )
    lines = [header, sub, "-" * len(sub)]
    for i, fault in enumerate(scores[0].faults):
        cells = []
        for s in scores:
            f = s.faults[i]
            count = f" ×{len(f.remedies)}" if len(f.remedies) > 1 else ""
            remedy = ("✓ " if f.right_action else "✗ ") + (f.cured_by or "none") + count
            if not f.triggered:
                remedy = "not reached"
            cells.append(
                f" {_fmt(f.detected):>3} {remedy:<18} {_fmt(f.detection_latency_s):>6} "
                f"{_fmt(f.mttr_s):>6} {f.steps_lost:>5} "
            )
        lines.append(f"{fault.kind:<19} {fault.at_step:>5} |" + "|".join(cells))
    return "\n".join(lines)


def system_table(scores: Sequence[SystemScore]) -> str:
    rows = [
        ("wall time (s)", lambda s: _fmt(s.wall_s)),
        ("final step / target", lambda s: f"{s.final_step} / {s.target_steps}"),
        ("good steps (NaN kept)", lambda s: f"{s.good_steps} ({s.bad_steps_kept})"),
        ("ETTR (own pace)", lambda s: _fmt(s.ettr, ".1%")),
        ("ETTR vs reference", lambda s: _fmt(s.ettr_vs_reference, ".1%")),
        ("ETTR vs reference, paced", lambda s: _fmt(s.ettr_vs_reference_paced, ".1%")),
        ("ETTR vs reference, local", lambda s: _fmt(s.ettr_vs_reference_local, ".1%")),
        ("final loss (reference)", lambda s: f"{_fmt(s.final_loss, '.4f')} "
                                             f"({_fmt(s.reference_loss, '.4f')})"),
        ("final loss Δ", lambda s: _fmt(s.loss_rel_diff, ".2%")),
        ("steps equal / compared", lambda s: f"{s.loss_steps_compared - s.loss_steps_unequal} / "
                                             f"{s.loss_steps_compared}"),
        ("remedies", lambda s: str(s.remedies)),
        ("false positives", lambda s: str(s.false_positives)),
        ("escalations", lambda s: str(s.escalations)),
        ("faults left uncured", lambda s: str(s.unrecovered)),
        ("faults right / cured", lambda s: f"{sum(f.right_action for f in s.faults)} / "
                                           f"{sum(f.recovered for f in s.faults)} of "
                                           f"{len(s.faults)}"),
    ]  # fmt: skip
    width = 24
    lines = [f"{'':<{width}}" + "".join(f"{s.system:>22}" for s in scores)]
    for label, get in rows:
        lines.append(f"{label:<{width}}" + "".join(f"{get(s):>22}" for s in scores))
    return "\n".join(lines)


def comparison(scores: Sequence[SystemScore]) -> str:
    return system_table(scores) + "\n\n" + fault_table(scores)
