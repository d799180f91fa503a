"""The exact reference's plan (pure): which samples, skips, resumes and updates it replays."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.soak.progress import Progress, StartEvent, StepEvent
from benchmarks.soak.reference import (
    PlanError,
    ReferencePlan,
    Segment,
    compare_losses,
    consumed,
    plan,
)
from megatron_runs.sampling import take_step

GBS = 8


def group(
    p: Progress,
    t0: float,
    inc: str,
    first: int,
    last: int,
    skips: tuple[tuple[int, int], ...],
    bad: tuple[int, ...] = (),
) -> None:
    """A process group's log: resumed at `first` (its cursor replayed from the lineage so
    far) with `skips`, one step a second; `bad` steps threw their update away."""
    cursor = max((e.consumed for e in p.steps if e.step == first and e.t < t0), default=0)
    p.starts.append(StartEvent(t0, first, inc, (), cursor, skips))
    for i, step in enumerate(range(first + 1, last + 1)):
        cursor = take_step(cursor, GBS, skips).next_cursor
        p.steps.append(StepEvent(t0 + 1 + i, step, 1.0 / step, inc, step in bad, None, cursor))
    p.starts.sort(key=lambda e: e.t)
    p.steps.sort(key=lambda e: e.t)


POISON_NAN = {"kind": "poison_data", "start_sample": 256, "end_sample": 264, "effect": "nan"}


def test_a_rollback_whose_skip_lies_ahead_replays_as_one_clean_run_with_that_skip() -> None:
    """Rolled back from step 40 to 30 skipping [256, 272) (step 33 onwards), then a crash
    restart at 60: every step consumes what a clean run with that skip consumes."""
    p = Progress()
    group(p, 0, "1/1", 0, 40, (), bad=(33,))
    group(p, 100, "2/2", 30, 70, ((256, 272),))
    group(p, 200, "3/3", 60, 150, ((256, 272),))
    ref = plan(p, [POISON_NAN, {"kind": "node", "job_node": 0, "effect": "nan_grads"}], GBS)
    assert ref.segments == (Segment(0, 150, ((256, 272),)),)
    assert ref.faults == (POISON_NAN,)  # the data fault, never the node fault
    assert ref.emulated_steps == ()
    assert ref.segments[0].train_args(last=True) == ["--skip", "256:272"]


def test_a_skip_behind_the_resume_point_makes_the_reference_resume_there_too() -> None:
    """A skip range over samples trained before the group's resume step would change those
    steps in a clean run: the reference stops where Nightwatch resumed and resumes there."""
    p = Progress()
    group(p, 0, "1/1", 0, 60, ())
    group(p, 100, "2/2", 60, 150, ((100, 120),))
    ref = plan(p, [], GBS)
    assert ref.segments == (Segment(0, 60, ()), Segment(60, 150, ((100, 120),)))
    first, last = ref.segments
    assert first.train_args(last=False) == ["--stop-at-step", "60"]
    assert last.train_args(last=True) == ["--resume-step", "60", "--skip", "100:120"]
    assert consumed(ref.segments, GBS)[61] == tuple(range(480, 488))


def test_a_skipped_update_no_poison_explains_is_recreated_over_that_steps_samples() -> None:
    """A NaN node's step 45 stayed in the history (its update thrown away, its loss
    finite): the reference throws the same update away with a NaN poison over step 45's
    samples, and that step is compared by both updates being skipped."""
    p = Progress()
    group(p, 0, "1/1", 0, 100, (), bad=(45,))
    ref = plan(p, [], GBS)
    assert ref.emulated_steps == (45,)
    assert ref.faults == (
        {"kind": "poison_data", "start_sample": 352, "end_sample": 360, "effect": "nan"},
    )
    mirror = Progress(list(p.starts), [
        replace(e, loss=float("nan")) if e.step == 45 else e for e in p.steps
    ])  # fmt: skip
    assert compare_losses(p, mirror, ref.emulated_steps).equal
    assert not compare_losses(p, mirror).equal  # not emulated: a finite loss vs NaN
    applied = Progress(list(p.starts), [
        replace(e, skipped_update=False) if e.step == 45 else e for e in mirror.steps
    ])  # fmt: skip
    assert not compare_losses(p, applied, ref.emulated_steps).equal


def test_a_history_the_skips_do_not_explain_is_refused() -> None:
    """The log's cursor must be the plan's at every step: skips the supervisor recorded but
    the trainer did not use would make a reference of another run."""
    p = Progress()
    group(p, 0, "1/1", 0, 40, ())
    group(p, 100, "2/2", 30, 60, ((256, 272),))
    lying = Progress(
        [replace(s, skips=()) if s.incarnation == "2/2" else s for s in p.starts], p.steps
    )
    with pytest.raises(PlanError, match="step 33: the trainer's cursor 280, the plan's 264"):
        plan(lying, [], GBS)
    with pytest.raises(PlanError, match="no step"):
        plan(Progress(), [], GBS)
    torn = Progress(list(p.starts), [e for e in p.steps if e.step != 20])
    with pytest.raises(PlanError, match="step 20 is missing from the log"):
        plan(torn, [], GBS)


def test_the_plan_is_recorded_as_json() -> None:
    ref = ReferencePlan((Segment(0, 60, ((1, 2),)),), (POISON_NAN,), (45,))
    assert ref.to_dict() == {
        "segments": [{"resume_step": 0, "stop_step": 60, "skips": [[1, 2]]}],
        "faults": [POISON_NAN],
        "emulated_steps": [45],
    }
