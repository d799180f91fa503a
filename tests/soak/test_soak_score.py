"""Scoring on recorded progress: fault windows, MTTR, steps lost, ETTR, loss vs reference."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from benchmarks.soak.progress import (
    Progress,
    StartEvent,
    StepEvent,
    final_trajectory,
    parse_lines,
)
from benchmarks.soak.schedule import FaultKind, ScheduledFault
from benchmarks.soak.score import (
    Injection,
    Remedy,
    SystemScore,
    comparison,
    excess_s,
    pace_s,
    score_system,
    steps_lost,
)
from benchmarks.soak_stretches import Beside, Parts, beside_imports, parts, stretches


def run(segments: list[tuple[float, int, int, str]], loss=lambda s: 10.0 / (1 + s)) -> Progress:
    """(start time, from step, to step, incarnation) segments at one step per second."""
    p = Progress()
    for t0, first, last, inc in segments:
        p.starts.append(StartEvent(t0, first, inc))
        for i, step in enumerate(range(first + 1, last + 1)):
            p.steps.append(StepEvent(t0 + 1 + i, step, loss(step), inc))
    p.starts.sort(key=lambda e: e.t)
    p.steps.sort(key=lambda e: e.t)
    return p


REF = run([(0.0, 0, 100, "1/1")])
POISON = Injection(ScheduledFault(FaultKind.POISON_DATA, 41, {}), None)
CRASH = Injection(ScheduledFault(FaultKind.RANK_CRASH, 80, {"rank": 1}), 200.0)


def test_parse_keeps_starts_and_steps_of_the_trainer_log() -> None:
    lines = [
        "submitit INFO starting",
        json.dumps({"ts": 5, "event": "train_start", "step": 20, "attempt": 2, "job_id": "7"}),
        json.dumps(
            {
                "ts": 6,
                "event": "step",
                "step": 21,
                "loss": "nan",
                "attempt": 2,
                "job_id": "7",
                "skipped_update": True,
            }
        ),
        '{"ts": 7, "event": "step", "step": 22, "lo',  # torn line
    ]
    p = parse_lines(lines)
    assert [s.step for s in p.starts] == [20] and p.starts[0].incarnation == "7/2"
    (ev,) = p.steps
    assert ev.bad and math.isnan(ev.loss)


def test_final_trajectory_is_cut_back_at_each_resume() -> None:
    p = run([(0, 0, 50, "1/1"), (60, 40, 100, "2/2")])
    traj = final_trajectory(p)
    assert sorted(traj) == list(range(1, 101))
    assert traj[45].incarnation == "2/2" and traj[40].incarnation == "1/1"
    assert steps_lost(p, p.starts[1:]) == 10


def test_rollback_fault_scored_against_reference() -> None:
    # poisoned at step 41 (its step began at t=40), rollback decided at t=52, restart at
    # t=60 from step 40, first good step at t=61; a crash injected at t=200 restarts at 205.
    p = run([(0, 0, 50, "1/1"), (60, 40, 80, "2/2"), (205, 70, 100, "3/3")])
    nw = score_system(
        "nightwatch",
        injections=[POISON, CRASH],
        progress=p,
        remedies=[Remedy(52.0, "rollback"), Remedy(203.0, "restart")],
        escalations=0,
        submit_t=-2.0,
        end_t=240.0,
        target_steps=100,
        reference=REF,
        reference_submit_t=-2.0,
    )
    poison, crash = nw.faults
    assert poison.detected and poison.cured_by == "rollback" and poison.right_action
    assert poison.fault_t == 40 and poison.detection_latency_s == 12
    assert poison.recovered and poison.mttr_s == 21 and poison.steps_lost == 10
    assert crash.right_action and crash.mttr_s == 6 and crash.steps_lost == 10
    assert nw.reached_target and nw.bad_steps_kept == 0 and nw.false_positives == 0
    assert nw.loss_rel_diff == 0.0
    assert nw.ettr == 100 * 1.0 / 242  # 100 good steps × 1 s / wall
    assert nw.ettr_vs_reference == 102 / 242
    assert nw.ettr_vs_reference_paced == 102 / 242  # both at 1 s a step
    slower = run([(0.0, 0, 100, "1/1")])  # the same reference, its machine 2× slower
    slower.steps = [replace(e, t=2 * e.t) for e in slower.steps]
    paced = score_system(
        "nightwatch", injections=[], progress=p, remedies=[], escalations=0, submit_t=-2.0,
        end_t=240.0, target_steps=100, reference=slower, reference_submit_t=-4.0,
    )  # fmt: skip
    assert paced.ettr_vs_reference == 204 / 242 and paced.ettr_vs_reference_paced == 102 / 242
    text = comparison([nw])
    assert "rollback" in text and "ETTR" in text


def test_baseline_that_never_restarts_is_not_detected_and_keeps_bad_steps() -> None:
    p = run([(0, 0, 100, "1/1")], loss=lambda s: math.nan if 41 <= s <= 42 else 1.0)
    for i, e in enumerate(p.steps):
        if e.step in (41, 42):
            p.steps[i] = StepEvent(e.t, e.step, e.loss, e.incarnation, skipped_update=True)
    base = score_system(
        "baseline", injections=[POISON], progress=p, remedies=[], escalations=0,
        submit_t=0.0, end_t=101.0, target_steps=100, reference=REF, reference_submit_t=0.0,
    )  # fmt: skip
    (poison,) = base.faults
    assert not poison.detected and not poison.right_action and not poison.recovered
    assert poison.note == "no remedy; skipped updates kept in the final model at steps [41, 42]"
    assert base.bad_steps_kept == 2 and base.good_steps == 98


def test_a_contained_nan_batch_is_cured_by_containment_with_no_step_lost() -> None:
    """NaN samples [320, 328) at step 41: the update was skipped, the supervisor recorded the
    contained incident at t=43 and took no action; the crash's later restart is the crash's."""
    p = run([(0, 0, 80, "1/1"), (205, 70, 100, "2/2")])
    for i, e in enumerate(p.steps):
        if e.step == 41:
            p.steps[i] = StepEvent(e.t, e.step, math.nan, e.incarnation, skipped_update=True)
    window = {"start_sample": 320, "end_sample": 328, "effect": "nan"}
    nan_batch = Injection(ScheduledFault(FaultKind.POISON_DATA, 41, window), None)
    held = Remedy(43.0, "contained", cause="nonfinite", skips=((320, 328),))
    nw = score_system(
        "nightwatch", injections=[nan_batch, CRASH], progress=p,
        remedies=[held, Remedy(203.0, "restart")], escalations=0, submit_t=0.0, end_t=240.0,
        target_steps=100, reference=None, reference_submit_t=None,
    )  # fmt: skip
    contained, crash = nw.faults
    assert contained.cured_by == "contained" and contained.right_action and contained.recovered
    assert contained.steps_lost == 0 and contained.samples_skipped == 0
    assert contained.mttr_s == 2.0  # step 42, the next good one, ended at t=42; the fault at 40
    assert crash.right_action and crash.steps_lost == 10 and nw.false_positives == 0
    # A rollback is not the cure of a NaN batch the trainer contains.
    rolled = score_system(
        "nightwatch", injections=[nan_batch], progress=p,
        remedies=[Remedy(43.0, "rollback", cause="nonfinite", skips=((320, 336),))],
        escalations=0, submit_t=0.0, end_t=240.0, target_steps=100, reference=None,
        reference_submit_t=None,
    )  # fmt: skip
    (f,) = rolled.faults
    assert not f.right_action and (f.samples_skipped, f.skip_allowance) == (16, 8)


def test_infra_fault_right_action_is_no_remedy_and_untriggered_is_reported() -> None:
    prom = Injection(ScheduledFault(FaultKind.PROMETHEUS_RESTART, 30, {"down_s": 10}), 30.5)
    never = Injection(ScheduledFault(FaultKind.NODE_DEATH, 500, {"job_node": 1}), None)
    s = score_system(
        "nightwatch", injections=[prom, never], progress=REF,
        remedies=[Remedy(35.0, "restart")], escalations=0, submit_t=0.0, end_t=101.0,
        target_steps=100, reference=REF, reference_submit_t=0.0,
    )  # fmt: skip
    prom_score, never_score = s.faults
    assert prom_score.detected and not prom_score.right_action  # a remedy while Prometheus was down
    assert s.false_positives == 1
    assert not never_score.triggered and never_score.note == "not injected"


def test_nan_node_fault_counts_from_when_the_job_first_ran_on_the_node() -> None:
    """Armed at step 30, but the job ran elsewhere until a later restart put it on the sick
    node at t=120, where step 61's update was thrown away: the fault's window starts there,
    so the exclusion decided at t=125 is its cure, not a remedy of some earlier fault."""
    p = run([(0, 0, 60, "1/1"), (120, 60, 100, "2/2")])
    for i, e in enumerate(p.steps):
        if e.incarnation == "2/2" and e.step in (61, 62):
            p.steps[i] = StepEvent(e.t, e.step, e.loss, e.incarnation, skipped_update=True)
    nan = Injection(ScheduledFault(FaultKind.NAN_NODE, 30, {"job_node": 0}), None, node="n1")

    def scored(excluded: tuple[str, ...]) -> SystemScore:
        return score_system(
            "nightwatch", injections=[nan], progress=p,
            remedies=[Remedy(125.0, "exclude_node", excluded)], escalations=0, submit_t=0.0,
            end_t=200.0, target_steps=100, reference=REF, reference_submit_t=0.0,
        )  # fmt: skip

    s = scored(("n1",))
    (score,) = s.faults
    assert score.fault_t == 120 and score.detection_latency_s == 5
    assert score.right_action and s.false_positives == 0
    # Excluding a healthy node is the wrong action, however the fault then went away.
    assert not scored(("n2",)).faults[0].right_action
    clean = score_system(
        "nightwatch", injections=[nan], progress=REF, remedies=[], escalations=0,
        submit_t=0.0, end_t=101.0, target_steps=100, reference=REF, reference_submit_t=0.0,
    )  # fmt: skip
    assert not clean.faults[0].triggered
    # No node pinned: the fault never struck, whatever else threw updates away.
    unpinned = score_system(
        "nightwatch", injections=[replace(nan, node=None)], progress=p, remedies=[],
        escalations=0, submit_t=0.0, end_t=200.0, target_steps=100, reference=REF,
        reference_submit_t=0.0,
    )  # fmt: skip
    assert not unpinned.faults[0].triggered


def _place(p: Progress, placed: dict[str, tuple[str, ...]]) -> None:
    """Give each process group of `p` the nodes it ran on."""
    p.starts = [
        StartEvent(s.t, s.step, s.incarnation, nodes=placed[s.incarnation]) for s in p.starts
    ]


def test_straggler_counts_from_the_first_job_on_its_node_not_from_its_arming_step() -> None:
    """A straggler armed at step 30 (before the poison, in schedule order)
    struck only when the poison's rollback put the job on n1 (t=120). Dated by its arming step,
    its exclusion fell into the poison's window and both faults were scored wrong; the group
    that recovers the poison is also the one the straggler slows."""
    p = run([(0, 0, 60, "1/1"), (120, 40, 70, "2/2"), (160, 60, 100, "3/3")])
    _place(p, {"1/1": ("n2", "n3"), "2/2": ("n1", "n2"), "3/3": ("n2", "n3")})
    slow = Injection(ScheduledFault(FaultKind.STRAGGLER, 30, {"job_node": 0}), None, node="n1")
    s = score_system(
        "nightwatch", injections=[slow, POISON], progress=p,
        remedies=[Remedy(52.0, "rollback"), Remedy(150.0, "exclude_node", ("n1",))],
        escalations=0, submit_t=0.0, end_t=200.0, target_steps=100, reference=REF,
        reference_submit_t=0.0,
    )  # fmt: skip
    straggler, poison = s.faults
    assert poison.fault_t == 40 and poison.remedies == ["rollback"] and poison.right_action
    assert poison.recovered and poison.mttr_s == 81  # group 2/2's first step, at t=121
    assert straggler.fault_t == 120 and straggler.detection_latency_s == 30
    assert straggler.right_action and straggler.recovered and s.false_positives == 0


def test_a_fault_whose_cure_lands_on_the_next_fault_recovers_with_the_cure_after() -> None:
    """The poison's rollback put the job on n1, whose armed
    NaN fault threw away every update of that group at once. The poison recovers with the
    first group after the exclusion that trains on, not never."""
    p = run([(0, 0, 60, "1/1"), (56, 40, 45, "2/2"), (70, 40, 100, "3/3")])
    for i, e in enumerate(p.steps):
        if e.incarnation == "2/2":
            p.steps[i] = StepEvent(e.t, e.step, e.loss, e.incarnation, skipped_update=True)
    _place(p, {"1/1": ("n2", "n3"), "2/2": ("n1", "n2"), "3/3": ("n2", "n3")})
    nan = Injection(ScheduledFault(FaultKind.NAN_NODE, 30, {"job_node": 0}), None, node="n1")
    s = score_system(
        "nightwatch", injections=[POISON, nan], progress=p,
        remedies=[Remedy(52.0, "rollback"), Remedy(60.0, "exclude_node", ("n1",))],
        escalations=0, submit_t=0.0, end_t=200.0, target_steps=100, reference=REF,
        reference_submit_t=0.0,
    )  # fmt: skip
    poison, sick = s.faults
    assert sick.fault_t == 56 and sick.right_action and sick.recovered
    assert poison.remedies == ["rollback"] and poison.right_action
    assert poison.recovered and poison.mttr_s == 31  # group 3/3's first step, at t=71


def test_the_loss_is_compared_step_by_step_and_exactly() -> None:
    """Equal at every step, or not: one step off in the last digit is a mismatch, and the
    final loss's relative difference only says how far."""
    same = score_system(
        "nightwatch", injections=[], progress=REF, remedies=[], escalations=0,
        submit_t=0.0, end_t=101.0, target_steps=100, reference=REF, reference_submit_t=0.0,
    )  # fmt: skip
    assert same.loss_equal and same.loss_steps_compared == 100 and same.loss_steps_unequal == 0
    assert same.final_loss == same.reference_loss == 10.0 / 101
    nudged = run([(0.0, 0, 100, "1/1")], loss=lambda s: math.nextafter(10.0 / (1 + s), 0.0)
                 if s == 99 else 10.0 / (1 + s))  # fmt: skip
    off = score_system(
        "nightwatch", injections=[], progress=nudged, remedies=[], escalations=0,
        submit_t=0.0, end_t=101.0, target_steps=100, reference=REF, reference_submit_t=0.0,
    )  # fmt: skip
    assert off.loss_equal is False and off.loss_steps_unequal == 1
    assert off.loss_mismatches == [(99, math.nextafter(0.1, 0.0), 0.1)]
    assert off.loss_rel_diff == 0.0  # the final step itself is equal
    unreferenced = score_system(
        "nightwatch", injections=[], progress=REF, remedies=[], escalations=0,
        submit_t=0.0, end_t=101.0, target_steps=100, reference=None, reference_submit_t=None,
    )  # fmt: skip
    assert unreferenced.loss_equal is None


def nw_remedy(t: float, kind: str, cause: str, job: str, **kw) -> Remedy:
    """A remedy as Nightwatch records it: with the finding that caused it and its job."""
    return Remedy(t, kind, cause=cause, job_id=job, **kw)


def test_a_rollback_to_before_a_scheduled_fault_is_scored_by_cause() -> None:
    """Issue 20, seed 5: a poisoned batch at step 41 was rolled back to step 30 after the NaN
    node armed at step 50 had struck; by time windows the rollback fell into the NaN node's
    window ("cured by None" for the poison). Matched by cause, the rollback names the
    poisoned samples and the exclusion names the pinned node."""
    p = run([(0, 0, 55, "1/1"), (60, 30, 60, "2/2"), (100, 40, 100, "3/3")])
    for i, e in enumerate(p.steps):
        if (e.incarnation == "1/1" and (e.step == 41 or e.step >= 50)) or (
            e.incarnation == "2/2" and e.step >= 50
        ):
            p.steps[i] = StepEvent(e.t, e.step, e.loss, e.incarnation, skipped_update=True)
    _place(p, {"1/1": ("n1", "n2"), "2/2": ("n1", "n2"), "3/3": ("n2", "n3")})
    poison = Injection(
        ScheduledFault(FaultKind.POISON_DATA, 41, {"start_sample": 320, "end_sample": 328}), None
    )
    nan = Injection(ScheduledFault(FaultKind.NAN_NODE, 50, {"job_node": 0}), None, node="n1")
    s = score_system(
        "nightwatch", injections=[poison, nan], progress=p,
        remedies=[
            nw_remedy(56.0, "rollback", "nonfinite", "1", skips=((320, 544),),
                      attempt_nodes=("n1", "n2")),
            nw_remedy(95.0, "exclude_node", "nonfinite", "2", nodes=("n1",),
                      finding_nodes=("n1",), attempt_nodes=("n1", "n2")),
        ],
        escalations=0, submit_t=0.0, end_t=200.0, target_steps=100, reference=REF,
        reference_submit_t=0.0,
    )  # fmt: skip
    pois, sick = s.faults
    assert sick.fault_t == 49  # step 50 of group 1/1 began when step 49 ended
    assert pois.fault_t == 40 and pois.remedies == ["rollback"] and pois.right_action
    assert pois.steps_lost == 25  # group 1/1 reached 55, group 2/2 resumed at 30
    assert sick.remedies == ["exclude_node"] and sick.right_action and sick.recovered
    assert sick.detection_latency_s == 46 and sick.steps_lost == 20  # 60 → 40
    assert s.false_positives == 0


def test_two_faults_in_one_recovery_each_get_their_own_remedy() -> None:
    """A rank crash lands while a poisoned batch is still undetected: the restart (the job
    failed) replays the poison, whose rollback follows. Both recover with group 3/3."""
    p = run([(0, 0, 46, "1/1"), (50, 40, 45, "2/2"), (60, 40, 100, "3/3")])
    for i, e in enumerate(p.steps):
        if e.step == 41 and e.incarnation in ("1/1", "2/2"):
            p.steps[i] = StepEvent(e.t, e.step, e.loss, e.incarnation, skipped_update=True)
    poison = Injection(
        ScheduledFault(FaultKind.POISON_DATA, 41, {"start_sample": 320, "end_sample": 328}), None
    )
    crash = Injection(ScheduledFault(FaultKind.RANK_CRASH, 45, {"rank": 1}), 45.5, job_id="1")
    s = score_system(
        "nightwatch", injections=[poison, crash], progress=p,
        remedies=[
            nw_remedy(48.0, "restart", "job_failed", "1"),
            nw_remedy(55.0, "rollback", "nonfinite", "2", skips=((320, 328),)),
        ],
        escalations=0, submit_t=0.0, end_t=200.0, target_steps=100, reference=REF,
        reference_submit_t=0.0,
    )  # fmt: skip
    pois, crashed = s.faults
    assert crashed.remedies == ["restart"] and crashed.right_action
    assert crashed.detection_latency_s == 2.5 and crashed.mttr_s == 50 - 45.5 + 2
    assert pois.remedies == ["rollback"] and pois.right_action and pois.detection_latency_s == 15
    assert pois.mttr_s == 21  # group 3/3's first step, at t=61
    assert s.false_positives == 0


def test_a_time_limit_whose_job_another_remedy_left_strikes_nothing() -> None:
    """Job 1's limit was cut at t=30, its successor (job 2) prepared; a loss spike at step 40
    was rolled back into job 2 before the limit came. The cut is scored as moved, not as
    uncured; had the rollback restarted inside job 1, the limit would still be its own."""
    p = run([(0, 0, 45, "1/1"), (50, 35, 100, "2/2")])
    poison = Injection(
        ScheduledFault(FaultKind.POISON_DATA, 41, {"start_sample": 320, "end_sample": 344}), None
    )
    cut = Injection(ScheduledFault(FaultKind.WALLTIME, 30, {}), 30.0, job_id="1")
    rollback = nw_remedy(47.0, "rollback", "loss_spike", "1", skips=((320, 344),))

    def scored(moved_to: str) -> list:
        return score_system(
            "nightwatch", injections=[cut, poison], progress=p,
            remedies=[replace(rollback, moved_to=moved_to)], escalations=0, submit_t=0.0,
            end_t=200.0, target_steps=100, reference=REF, reference_submit_t=0.0,
        ).faults  # fmt: skip

    walltime, spike = scored("2")
    assert spike.right_action and spike.remedies == ["rollback"]
    assert walltime.triggered and walltime.right_action and walltime.cured_by == "moved"
    assert (
        walltime.remedies == [] and "left for job 2 by the rollback 17.0 s after" in walltime.note
    )
    walltime, _ = scored("1")
    assert walltime.cured_by is None and not walltime.right_action
    # a fault of the control plane's own is not done to the job: no remedy stays its cure
    outage = Injection(
        ScheduledFault(FaultKind.PROMETHEUS_RESTART, 30, {"down_s": 5}), 30.0, job_id="1"
    )
    scored_outage, _ = score_system(
        "nightwatch", injections=[outage, poison], progress=p,
        remedies=[replace(rollback, moved_to="2")], escalations=0, submit_t=0.0, end_t=200.0,
        target_steps=100, reference=REF, reference_submit_t=0.0,
    ).faults  # fmt: skip
    assert scored_outage.cured_by is None and scored_outage.right_action


def test_a_remedy_of_another_cause_is_a_false_positive_not_a_cure() -> None:
    """A restart of a job that nothing crashed is no cure for the crash of another job."""
    crash = Injection(ScheduledFault(FaultKind.RANK_CRASH, 45, {"rank": 1}), 45.5, job_id="1")
    s = score_system(
        "nightwatch", injections=[crash], progress=REF,
        remedies=[nw_remedy(48.0, "restart", "job_failed", "7"),
                  nw_remedy(50.0, "rollback", "loss_spike", "1", skips=((0, 8),))],
        escalations=0, submit_t=0.0, end_t=101.0, target_steps=100, reference=REF,
        reference_submit_t=0.0,
    )  # fmt: skip
    (score,) = s.faults
    assert not score.detected and score.cured_by is None and s.false_positives == 2


def test_poisoned_samples_strike_when_first_trained_and_a_skipped_window_never_does() -> None:
    """The trainer's cursor says which step trained a poisoned sample: after a rollback that
    skipped [256, 544), a window inside it is never trained and says so."""
    p = Progress()
    p.starts = [
        StartEvent(0.0, 0, "1/1", cursor=0),
        StartEvent(50.0, 30, "2/2", cursor=240, skips=((256, 544),)),
    ]
    p.steps = [StepEvent(float(s), s, 1.0, "1/1", consumed=8 * s) for s in range(1, 41)] + [
        StepEvent(50.0 + s - 30, s, 1.0, "2/2", consumed=8 * s + (288 if s > 32 else 0))
        for s in range(31, 60)
    ]
    hit = ScheduledFault(FaultKind.POISON_DATA, 33, {"start_sample": 256, "end_sample": 264})
    later = ScheduledFault(FaultKind.POISON_DATA, 50, {"start_sample": 392, "end_sample": 400})
    s = score_system(
        "nightwatch", injections=[Injection(hit, None), Injection(later, None)], progress=p,
        remedies=[], escalations=0, submit_t=0.0, end_t=100.0, target_steps=59, reference=None,
        reference_submit_t=None,
    )  # fmt: skip
    first, never = s.faults
    assert first.fault_t == 32.0  # step 33 (samples [256, 264)) began when step 32 ended
    assert first.note == ""  # rolled back: the final model never trained them
    assert not never.triggered
    assert (
        never.note == "never struck: samples [392, 400) were skipped before any step trained them"
    )


def test_parse_reads_the_nodes_a_group_ran_on() -> None:
    line = {"ts": 5, "event": "train_start", "step": 0, "attempt": 1, "job_id": "7"}
    (start,) = parse_lines([json.dumps({**line, "nodes": ["n1", "n2"]})]).starts
    assert start.nodes == ("n1", "n2")
    assert parse_lines([json.dumps(line)]).starts[0].nodes == ()


def test_the_pace_counts_saves_but_not_restarts() -> None:
    """One step a second, a 2 s save after every 10th step, and a 30 s restart: the pace is
    1.2 s a step (the median single gap would say 1 s and call the saves lost time)."""
    p = Progress()
    t = 0.0
    for step in range(1, 61):
        t += 1.0 + (2.0 if step % 10 == 1 and step > 1 else 0.0)
        if step == 31:
            t += 30.0
        p.steps.append(StepEvent(t, step, 1.0, "1/1" if step <= 30 else "2/2"))
    assert pace_s(p, 10) == pytest.approx(1.2)
    assert pace_s(p, 100) is None


def test_time_lost_is_read_at_each_stretchs_own_pace() -> None:
    """The machine halves its speed at step 50 (a fault's step) and a restart after step 75
    takes 30 s: each stretch at its own pace loses 0, 0 and 30 s, where one pace for the run
    (1.05 s) reads the slow half as lost and the reference's 1 s steps make the raw ratio 0.56.
    ETTR against the reference at local paces: 1 − (30 − 0) / 180."""
    p = Progress()
    t = 0.0
    for step in range(1, 101):
        t += 1.0 if step <= 50 else 2.0
        if step == 76:
            t += 30.0
        p.steps.append(StepEvent(t, step, 10.0 / (1 + step), "1/1" if step <= 75 else "2/2"))
    ref = run([(0.0, 0, 100, "1/1")])
    assert excess_s(p, [50, 75, 100], 0.0, 10) == 30.0
    assert excess_s(ref, [50, 75, 100], 0.0, 10) == 0.0
    assert excess_s(p, [50, 101], 0.0, 10) is None
    faults = [
        Injection(ScheduledFault(FaultKind.STRAGGLER, 50, {}), None),
        Injection(ScheduledFault(FaultKind.RANK_CRASH, 75, {"rank": 1}), 150.0),
    ]
    nw = score_system(
        "nightwatch", injections=faults, progress=p, remedies=[Remedy(152.0, "restart")],
        escalations=0, submit_t=0.0, end_t=180.0, target_steps=100, reference=ref,
        reference_submit_t=0.0,
    )  # fmt: skip
    assert nw.ettr_vs_reference == 100 / 180 and nw.ettr_vs_reference_paced == 105 / 180
    assert nw.ettr_vs_reference_local == 1 - 30 / 180
    assert "ETTR vs reference, local" in comparison([nw])


def test_a_record_behind_another_ranks_unfinished_output_is_kept() -> None:
    """A node's ranks share its log file: rank 1's warning without a newline put rank 0's
    `train_start` in mid-line, and the soak would lose that restart."""
    record = {"ts": 5, "event": "train_start", "step": 20, "attempt": 2, "job_id": "7"}
    line = "/work/main/megatron_runs/cpu_compat.py:218: UserWarnin" + json.dumps(record)
    assert [s.step for s in parse_lines([line]).starts] == [20]


def test_an_unseen_poison_says_which_steps_of_the_final_model_trained_it() -> None:
    """Issue 20, seed 11: a spike window nobody remedied; the score names the steps whose
    poisoned samples the final model kept (and any update the trainer threw away)."""
    p = Progress()
    p.starts = [StartEvent(0.0, 0, "1/1", cursor=0)]
    p.steps = [
        StepEvent(float(s), s, 1.0, "1/1", skipped_update=s == 30, consumed=8 * s)
        for s in range(1, 41)
    ]
    spike = ScheduledFault(FaultKind.POISON_DATA, 29, {"start_sample": 224, "end_sample": 248})
    s = score_system(
        "nightwatch", injections=[Injection(spike, None, "armed in spec")], progress=p,
        remedies=[], escalations=0, submit_t=0.0, end_t=41.0, target_steps=40, reference=None,
        reference_submit_t=None,
    )  # fmt: skip
    (score,) = s.faults
    assert score.fault_t == 28.0 and not score.detected
    assert score.note == (
        "armed in spec; no remedy; the final model trained its samples at steps [29, 30, 31] "
        "(update skipped at [30])"
    )


def test_stretches_name_the_seconds_each_faults_recovery_cost() -> None:
    """Steps 0.25 s apart, with a 5 s stop after step 40 (a recovery): the stretch after the
    fault at 40 holds those 5 s beyond its pace; the others none."""
    progress = Progress()
    t = 100.0
    for step in range(1, 101):
        t += 0.25 + (5.0 if step == 41 else 0.0)
        progress.steps.append(StepEvent(t, step, 3.0, "1/1"))
    assert stretches(progress, [40, 100, 120]) == [0.0, 5.0, None]


def test_a_stretchs_excess_splits_into_its_stop_its_redone_steps_and_slow_steps() -> None:
    """Steps 0.25 s apart; after step 50 a 4 s stop, then steps 46-50 trained again (a
    rollback: 5 × 0.25 s) and steps 51-60 at 0.5 s (slow): the stretch's 7.75 s beyond its
    pace is 4 stop + 1.25 redone + 2.5 slow; the first stretch's 0 is all zeros."""
    progress = Progress()
    t = 0.0
    steps = [*range(1, 51), *range(46, 101)]
    for i, step in enumerate(steps):
        t += 0.25 + (4.0 if i == 50 else 0.0) + (0.25 if 50 < step <= 60 and i > 50 else 0.0)
        progress.steps.append(StepEvent(t, step, 3.0, "1/1" if i < 50 else "1/2"))
    assert stretches(progress, [40, 100]) == [0.0, 7.75]
    assert parts(progress, [40, 100]) == [Parts(0.0, 0.0, 0.0), Parts(4.0, 1.25, 2.5)]


def test_windows_beside_an_import_hold_their_slow_steps_and_a_stop_counts_one_pace() -> None:
    """Steps 0.25 s apart; steps 12-21 take 0.5 s (an import ran beside them, from 3 s to
    7 s) and a 5 s stop follows step 25: of the five 10-step windows, the one the import
    overlaps holds 2.5 s beyond the pace; the stop's window holds none (its stop counts as a
    pace: it is a recovery, not a slow step)."""
    progress = Progress()
    t = 0.0
    for step in range(1, 52):
        t += 0.25 + (0.25 if 12 <= step <= 21 else 0.0) + (5.0 if step == 26 else 0.0)
        progress.steps.append(StepEvent(t, step, 3.0, "1/1"))
    assert beside_imports(progress, [(3.0, 7.0)]) == Beside(1, 2.5, 4, 0.0)
    assert beside_imports(progress, []) == Beside(0, 0.0, 5, 2.5)
