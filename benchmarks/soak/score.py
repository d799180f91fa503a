"""Score a soak (pure): per fault and per system, from ground truth plus the remedies taken.

Definitions (the same for Nightwatch and the baseline):
- fault time: when the driver injected an external fault; for a spec-side fault, when the
  faulty step began (the first time training completed step `at_step - 1`; for a node fault,
  the first time a process group on the node it struck did: only there does it strike).
- a fault's window runs from its time to the next fault's time (faults are spaced so that
  each recovery happens inside its own window); remedies in the window belong to the fault.
- detected: some remedy was taken in the window; detection latency: first remedy − fault time.
- cured by: the last remedy of the window; right action: it is one of `schedule.CURES[kind]`
  (infra faults: no remedy at all is the right action), and an exclusion names the faulty node.
- recovered: a process group that started after the last remedy trained past its resume
  step; MTTR = that moment − fault time. When the next fault struck every such group of the
  window first (a restart placed on the sick node), the first later group that trains on.
- steps lost: for each restart in the window, the step the previous run had reached minus the
  step the restart resumed from.
- ETTR: good steps of the final trajectory × the system's own pace / wall time (submit →
  end), i.e. the share of the wall time that was useful training; steps whose update was
  thrown away (NaN/Inf) are not good. The pace is the median time per step over windows of
  `pace_window` consecutive steps of one process group (a window holds its checkpoint save),
  so restarts, detection, replayed steps and slow stretches are what it does not count.
  `ettr_vs_reference` is the reference run's time to the same final step / wall time
  (startup costs then count as useful); it also holds any drift in the machine's speed
  between the two runs (the reference's own pace moved by 15 % within one run in the ninth
  session), which the own pace does not.
- final loss: mean loss over the last `loss_window(target)` steps of the final trajectory,
  against the reference's mean over the same steps (a window long enough that sample noise
  stays well under the 2 % tolerance: see `LOSS_WINDOW_SHARE`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.soak.progress import (
    Progress,
    StepEvent,
    final_trajectory,
    mean_loss,
    time_to_step,
)
from benchmarks.soak.schedule import CURES, INFRA_FAULTS, NODE_FAULTS, FaultKind, ScheduledFault

#: The final loss is the mean over this share of the run (at least `MIN_LOSS_WINDOW` steps).
#: With a global batch of 8 sequences one step's loss varies by ≈ 17 % (seed-7 reference,
#: steps 9,000-10,000: σ 0.57 at a mean of 3.3), so once a rollback's skip has shifted the
#: samples, two runs' 32-step means differ by ≈ 4.6 % (one σ) by chance alone, more than the
#: 2 % tolerance (the seed-7 soak: +4.1 % over 32 steps, +0.02 % over 1,000); over 1,000
#: steps that chance difference is ≈ 0.8 %.
LOSS_WINDOW_SHARE = 0.1
MIN_LOSS_WINDOW = 32


def loss_window(target_steps: int) -> int:
    return max(MIN_LOSS_WINDOW, int(target_steps * LOSS_WINDOW_SHARE))


@dataclass(frozen=True)
class Remedy:
    """One remedy a system took: Nightwatch's recorded action, or a baseline restart."""

    t: float
    kind: str
    nodes: tuple[str, ...] = ()  # what an exclusion named


@dataclass(frozen=True)
class Injection:
    """A scheduled fault as it happened: when it was injected (None: not triggered)."""

    fault: ScheduledFault
    t: float | None
    note: str = ""
    node: str | None = None  # the node a node fault hit (its schedule names a place in the job)


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
    loss_window: int = MIN_LOSS_WINDOW

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fault_time(inj: Injection, progress: Progress) -> float | None:
    """External faults: injection time; spec-side faults: start of the faulty step.

    A node fault strikes the node that holds its place in the job when training first reaches
    its step; the training program pins that node (`Injection.node`; None: it never struck).
    A NaN node's time is the start of the first step at or past it whose update the trainer
    threw away; a hang's or a straggler's, the start of the first such step that a process
    group on the pinned node began (a later restart may land elsewhere first)."""
    if not inj.fault.spec_side:
        return inj.t
    if inj.fault.kind in NODE_FAULTS and inj.node is None:
        return None  # no node was pinned: it never struck
    if inj.fault.kind is FaultKind.NAN_NODE:
        first = next((e for e in progress.steps if e.step >= inj.fault.at_step and e.bad), None)
        return _step_start(progress, first) if first is not None else None
    if inj.node is not None:
        return _first_step_on(progress, inj.node, inj.fault.at_step)
    before = progress.first_reaching(max(0, inj.fault.at_step - 1))
    return before.t if before is not None else None


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


def _step_start(progress: Progress, event: StepEvent) -> float:
    """When `event`'s step began: the previous step's end in its process group, else its
    group's start."""
    earlier = [
        e.t for e in progress.steps if e.incarnation == event.incarnation and e.t < event.t
    ] + [s.t for s in progress.starts if s.incarnation == event.incarnation and s.t <= event.t]
    return max(earlier, default=event.t)


def score_fault(
    inj: Injection,
    t0: float | None,
    t1: float,
    progress: Progress,
    remedies: Sequence[Remedy],
) -> FaultScore:
    """One fault over its window [t0, t1) (t0 None: it never happened)."""
    kind = inj.fault.kind
    if t0 is None:
        return FaultScore(
            kind.value, inj.fault.at_step, None, False, [], False, None, None, False, False,
            None, 0, inj.note or "not triggered",
        )  # fmt: skip
    mine = [r for r in remedies if t0 <= r.t < t1]
    # (t0, t1]: the group a remedy started may be where the next fault strikes (a node fault
    # is dated by the first group on its node), and it still recovers this one.
    starts = [s for s in progress.starts if t0 < s.t <= t1]
    lost = steps_lost(progress, starts)
    if kind in INFRA_FAULTS:
        uninterrupted = not starts
        return FaultScore(
            kind.value, inj.fault.at_step, t0, True, [r.kind for r in mine], bool(mine), None,
            None, not mine, uninterrupted, None if uninterrupted else _mttr(progress, starts, t0),
            lost, inj.note,
        )  # fmt: skip
    cured_by = mine[-1].kind if mine else None
    last = mine[-1].t if mine else t0
    cured_in = [s for s in starts if s.t >= last]
    recovered_t = _recovery(progress, cured_in)
    if recovered_t is None and cured_in:
        # The next fault struck the group this remedy started before it trained a good step
        # (it was placed on the sick node): the first later group that does recovers both.
        recovered_t = _recovery(progress, [s for s in progress.starts if s.t > t1])
    return FaultScore(
        kind=kind.value,
        at_step=inj.fault.at_step,
        fault_t=t0,
        triggered=True,
        remedies=[r.kind for r in mine],
        detected=bool(mine),
        detection_latency_s=(mine[0].t - t0) if mine else None,
        cured_by=cured_by,
        right_action=cured_by in CURES[kind] and _right_node(inj, mine[-1] if mine else None),
        recovered=recovered_t is not None,
        mttr_s=None if recovered_t is None else recovered_t - t0,
        steps_lost=lost,
        note=inj.note,
    )


def _right_node(inj: Injection, cure: Remedy | None) -> bool:
    """An exclusion cures a node fault only when it names the faulty node."""
    node = inj.node
    return cure is None or cure.kind != "exclude_node" or node is None or node in cure.nodes


def _recovery(progress: Progress, starts: Sequence[Any]) -> float | None:
    """First step past its resume step of a process group that started in `starts`."""
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


def _mttr(progress: Progress, starts: Sequence[Any], t0: float) -> float | None:
    t = _recovery(progress, starts)
    return None if t is None else t - t0


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


def windows(times: Sequence[float | None], end: float) -> list[tuple[float | None, float]]:
    """Each fault's [t0, t1): up to the next fault that happened, or to the end. Times need
    not follow the schedule's order: a node fault strikes when a job first lands on its node."""
    out: list[tuple[float | None, float]] = []
    for t in times:
        later = [x for x in times if x is not None and t is not None and x > t]
        out.append((t, min(later) if later else end))
    return out


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
    loss_steps: int | None = None,
    pace_window: int = 10,
) -> SystemScore:
    traj = final_trajectory(progress)
    final_step = max(traj, default=0)
    good = sum(1 for e in traj.values() if not e.bad)
    bad = len(traj) - good
    times = [fault_time(i, progress) for i in injections]
    faults = [
        score_fault(inj, t0, t1, progress, remedies)
        for inj, (t0, t1) in zip(injections, windows(times, end_t), strict=True)
    ]
    fault_windows = [
        (t0, t1)
        for (t0, t1), inj in zip(windows(times, end_t), injections, strict=True)
        if t0 is not None and inj.fault.kind not in INFRA_FAULTS
    ]
    false_pos = sum(1 for r in remedies if not any(a <= r.t < b for a, b in fault_windows))
    wall = max(1e-9, end_t - submit_t)
    pace = pace_s(progress, pace_window)
    ettr = good * pace / wall if pace else None
    ettr_ref = None
    if reference is not None and reference_submit_t is not None and final_step:
        to_step = time_to_step(reference, final_step, reference_submit_t)
        ettr_ref = to_step / wall if to_step is not None else None
    final_loss, ref_loss, rel = None, None, None
    window_steps = loss_steps if loss_steps is not None else loss_window(target_steps)
    if final_step:
        window = range(max(1, final_step - window_steps + 1), final_step + 1)
        final_loss = mean_loss(traj, window)
        if reference is not None:
            ref_loss = mean_loss(final_trajectory(reference), window)
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
        loss_window=window_steps,
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
        ("final loss (reference)", lambda s: f"{_fmt(s.final_loss, '.4f')} "
                                             f"({_fmt(s.reference_loss, '.4f')})"),
        ("final loss Δ", lambda s: _fmt(s.loss_rel_diff, ".2%")),
        ("loss window (steps)", lambda s: str(s.loss_window)),
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
