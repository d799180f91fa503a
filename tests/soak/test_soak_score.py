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
    pace_s,
    score_system,
    steps_lost,
)


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
    assert base.bad_steps_kept == 2 and base.good_steps == 98


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
    assert not never_score.triggered and never_score.note == "not triggered"


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
    """The seed-7 soaks: a straggler armed at step 30 (before the poison, in schedule order)
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
    """The tenth session's short soak: the poison's rollback put the job on n1, whose armed
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


def test_final_loss_is_compared_over_a_tenth_of_the_run() -> None:
    """Per-step losses that differ by chance (different samples after a skip) but agree on
    average: 32 steps see the noise, a tenth of the run does not."""
    ref = run([(0, 0, 1000, "1/1")], loss=lambda s: 3.0 + (0.5 if s % 50 < 25 else -0.5))
    other = run([(0, 0, 1000, "1/1")], loss=lambda s: 3.0 + (-0.5 if s % 50 < 25 else 0.5))
    s = score_system(
        "nightwatch", injections=[], progress=other, remedies=[], escalations=0,
        submit_t=0.0, end_t=1001.0, target_steps=1000, reference=ref, reference_submit_t=0.0,
    )  # fmt: skip
    assert s.loss_window == 100 and s.loss_rel_diff is not None and s.loss_rel_diff < 0.01
    short = score_system(
        "nightwatch", injections=[], progress=other, remedies=[], escalations=0,
        submit_t=0.0, end_t=1001.0, target_steps=1000, reference=ref, reference_submit_t=0.0,
        loss_steps=32,
    )  # fmt: skip
    assert short.loss_rel_diff is not None and short.loss_rel_diff > 0.1


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


def test_a_record_behind_another_ranks_unfinished_output_is_kept() -> None:
    """A node's ranks share its log file: rank 1's warning without a newline put rank 0's
    `train_start` in mid-line, and the soak lost that restart (thirteenth session)."""
    record = {"ts": 5, "event": "train_start", "step": 20, "attempt": 2, "job_id": "7"}
    line = "/work/main/megatron_runs/cpu_compat.py:218: UserWarnin" + json.dumps(record)
    assert [s.step for s in parse_lines([line]).starts] == [20]
