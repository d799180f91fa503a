"""The overnight report's arithmetic and rendering, on recorded rows (pure, no I/O)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from report_scenario import RESTART_GAP_S, STEP_S, T0, at, scenario

from supervisor.metrics_in import LossPoint
from supervisor.metrics_in.promql import loss_from_matrix
from supervisor.report import (
    Report,
    build_report,
    format_duration,
    loss_from_checkpoints,
    mean_step_seconds,
    render_text,
    skip_windows,
)


def test_numbers_of_a_rolled_back_run() -> None:
    r = build_report(scenario())
    a1_end = 43 * STEP_S + 5
    wall = a1_end + RESTART_GAP_S + 30 * STEP_S + 3
    assert r.state == "succeeded" and r.attempts == 2
    assert r.wall_s == pytest.approx(wall)
    # from step 43 (the last advance) to attempt 2's first step, 31
    assert r.downtime_s == pytest.approx(a1_end - 43 * STEP_S + RESTART_GAP_S + STEP_S)
    assert r.steps_lost == 13
    assert r.mean_step_s == pytest.approx(STEP_S)
    # Productive: steps 1..60 once each (31..43 replayed after the rollback are not).
    assert r.ettr == pytest.approx(60 * STEP_S / wall)
    assert r.nodes_excluded == ["n2"]
    (incident,) = r.incidents
    assert incident.onset_step == 41
    assert incident.detection_latency_s == pytest.approx(3 * STEP_S + 1)
    assert incident.mttr_s == pytest.approx(at(a1_end + RESTART_GAP_S + 8).timestamp()
                                            - at(40 * STEP_S).timestamp())  # fmt: skip


def test_steps_lost_fall_back_to_the_replayed_stretch() -> None:
    r = build_report(scenario(steps_lost_recorded=False))
    assert r.steps_lost == 43 - 30


def test_windows_mark_the_replay_and_the_skipped_samples() -> None:
    windows = {w.kind: w for w in build_report(scenario()).windows}
    assert (windows["rollback"].start_step, windows["rollback"].end_step) == (30, 43)
    # samples [320, 352) with 8 per step are what steps 41..44 consume in a clean run
    assert (windows["skipped"].start_step, windows["skipped"].end_step) == (41, 44)


@pytest.mark.parametrize(
    ("lo", "hi", "gbs", "steps"), [(0, 8, 8, (1, 1)), (4, 20, 8, (1, 3)), (16, 17, 8, (3, 3))]
)
def test_skip_windows_cover_every_step_touching_the_range(
    lo: int, hi: int, gbs: int, steps: tuple[int, int]
) -> None:
    (w,) = skip_windows([[lo, hi]], gbs)
    assert (w.start_step, w.end_step) == steps


def test_an_active_run_counts_downtime_up_to_now() -> None:
    data = scenario(finished=False)
    attempts = [dict(data.attempts[0]), {**data.attempts[1], "started_at": None}]
    loss = [p for p in data.loss if p.attempt == 1]
    r = build_report(dataclasses.replace(data, attempts=attempts, loss=loss))
    assert r.ended_t is None
    assert r.downtime_s == pytest.approx(data.now - at(43 * STEP_S).timestamp())
    assert r.wall_s == pytest.approx(data.now - T0.timestamp())


def test_downtime_runs_from_the_last_advance_through_an_attempt_that_never_trained() -> None:
    """Counting only SLURM's gaps between attempts, a report says 18 s of downtime where
    restarts alone take ≈ 115 s. A hang's stall before
    detection, an attempt that hung at start-up and the next one's start-up are downtime."""
    data = scenario()
    a1, a2 = data.attempts
    stall_s, dud_s = 30.0, 50.0
    a1_last = 43 * STEP_S
    dud = {**a2, "number": 2, "state": "cancelled", "started_at": at(a1_last + stall_s + 10),
           "ended_at": at(a1_last + stall_s + 10 + dud_s)}  # fmt: skip
    a3_start = a1_last + stall_s + 10 + dud_s + 8
    a3 = {**a2, "number": 3, "started_at": at(a3_start), "ended_at": at(a3_start + 100)}
    hung = [LossPoint(43, 9.9, 1, at(a1_last + k).timestamp()) for k in range(1, int(stall_s))]
    loss = [p for p in data.loss if p.attempt == 1] + hung
    loss += [LossPoint(31, 2.0, 3, at(a3_start + 7).timestamp())]
    a1 = {**a1, "ended_at": at(a1_last + stall_s)}
    r = build_report(dataclasses.replace(data, attempts=[a1, dud, a3], loss=loss))
    assert r.downtime_s == pytest.approx(a3_start + 7 - a1_last)


def test_without_metrics_downtime_falls_back_to_the_attempts_times() -> None:
    data = scenario()
    r = build_report(dataclasses.replace(data, loss=[]))
    assert r.downtime_s == pytest.approx(RESTART_GAP_S)


def test_timeline_is_ordered_and_tells_the_story() -> None:
    r = build_report(scenario())
    assert [e.t for e in r.timeline] == sorted(e.t for e in r.timeline)
    whats = [e.what for e in r.timeline]
    assert whats == [
        "attempt", "fault", "detected", "action", "attempt", "attempt", "recovered", "attempt",
        "state",
    ]  # fmt: skip
    text = render_text(r)
    for expected in (
        "Run r-0ca11ed0beef (tiny-cpu): SUCCEEDED — reached train_steps, step 60/60",
        "loss_spike detected at step 41, 7s after onset",
        "rollback step 30 skip [320, 352) [done]",
        "attempt 2 started (job 102; nodes n1,n3; resume step 30; skip [320, 352))",
        "attempt 1 ended: cancelled (rollback)",
        "steps lost 13",
        "nodes excluded: n2",
        "skipped samples: [320, 352)",
        "run succeeded (reached train_steps)",
    ):
        assert expected in text, f"{expected!r} missing from:\n{text}"
    assert len(text.splitlines()) < 40  # one screen


def test_json_round_trips_and_is_strict_json() -> None:
    r = build_report(scenario())
    body = json.loads(r.to_json())
    assert body["steps_lost"] == 13 and body["incidents"][0]["kind"] == "loss_spike"
    assert Report.from_dict(body) == r


def test_an_empty_run_renders() -> None:
    data = scenario()
    run = {**data.run, "state": "pending", "last_step": None, "state_reason": None}
    r = build_report(type(data)(run=run, now=data.now))
    assert r.ettr is None and r.wall_s == 0 and r.timeline == []
    assert "never started" in render_text(r)


def test_an_active_run_reports_its_newest_step() -> None:
    data = scenario(finished=False)
    run = {**data.run, "last_step": None}  # recorded only when the run ends
    r = build_report(dataclasses.replace(data, run=run))
    assert r.last_step == 60  # attempt 2's newest point, not attempt 1's higher pre-rollback one
    assert "step 60/60" in render_text(r)


def test_loss_from_prometheus_matrices_pairs_by_attempt_and_time() -> None:
    steps = [
        {"metric": {"attempt": "1"}, "values": [[100, "5"], [101, "5"], [102, "6"], [103, "7"]]},
        {"metric": {"attempt": "2"}, "values": [[200, "3"]]},
    ]
    losses = [
        {"metric": {"attempt": "1"}, "values": [[100, "2.5"], [101, "2.5"], [102, "NaN"],
                                                 [103, "2.1"]]},
        {"metric": {"attempt": "2"}, "values": [[200, "2.9"], [201, "2.8"]]},
    ]  # fmt: skip
    points = loss_from_matrix(steps, losses)
    assert [(p.attempt, p.step, p.loss) for p in points] == [(1, 5, 2.5), (1, 7, 2.1), (2, 3, 2.9)]


def test_scrapes_before_an_attempts_first_step_are_no_loss_points() -> None:
    """A resumed process exports loss 0 at its resume step until its first step finishes:
    without the last-step time the report drew a loss of 0 at every restart."""
    steps = [{"metric": {"attempt": "2"}, "values": [[200, "30"], [201, "30"], [202, "31"]]}]
    losses = [{"metric": {"attempt": "2"}, "values": [[200, "0"], [201, "0"], [202, "2.7"]]}]
    last = [{"metric": {"attempt": "2"}, "values": [[200, "0"], [201, "0"], [202, "202"]]}]
    assert [(p.step, p.loss) for p in loss_from_matrix(steps, losses)] == [(30, 0.0), (31, 2.7)]
    assert [(p.step, p.loss) for p in loss_from_matrix(steps, losses, last)] == [(31, 2.7)]


def test_checkpoint_losses_skip_incomplete_and_nonfinite() -> None:
    rows = [
        {"step": 10, "loss": 3.0, "saved_at": at(10), "complete": True},
        {"step": 20, "loss": 2.0, "saved_at": at(20), "complete": False},
        {"step": 30, "loss": math.inf, "saved_at": at(30), "complete": True},
        {"step": 40, "loss": None, "saved_at": at(40), "complete": True},
    ]
    assert loss_from_checkpoints(rows) == [
        LossPoint(10, 3.0, None, at(10).timestamp(), "checkpoint")
    ]


def test_checkpoint_points_are_attributed_to_the_attempt_running_then() -> None:
    data = scenario(steps_lost_recorded=False)
    ckpt_only = type(data)(**{**data.__dict__, "loss": loss_from_checkpoints(data.checkpoints)})
    r = build_report(ckpt_only)
    assert {p.attempt for p in r.loss} == {1}
    # the replay is bounded by the newest checkpoint attempt 1 reached (40), not its last step
    assert r.steps_lost == 40 - 30


@pytest.mark.parametrize(
    ("seconds", "text"), [(None, "-"), (7, "7s"), (65, "1m 05s"), (3725, "1h 02m")]
)
def test_format_duration(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text


def test_ettr_counts_no_stuck_attempt_and_no_failed_submission_as_productive() -> None:
    """R1: a run whose newest attempt sits at one step, followed by failed submissions
    (attempts that never started), was reported at ETTR 0.98: only gaps between an end and
    the next start counted as downtime."""
    data = scenario(finished=False)
    wall = data.now - T0.timestamp()
    failed = [
        {"number": n, "job_id": None, "state": "failed", "started_at": None,
         "ended_at": at(wall - 10 * n), "end_reason": "submit failed", "resume_step": 30}
        for n in (3, 4, 5)
    ]  # fmt: skip
    r = build_report(dataclasses.replace(data, attempts=[*data.attempts, *failed]))
    assert r.ettr == pytest.approx(60 * STEP_S / wall)
    assert r.ettr < 0.05


def test_the_step_time_holds_the_saves_as_the_wall_clock_does() -> None:
    """0.16 s steps and a 0.5 s save every 10 steps, scraped every second: whether a scrape
    interval holds a save decides its rate, so the median of the rates is not the mean step
    (0.20 s against 0.21 s here); over 9,000 steps such a gap outlasts the run and the report
    would say ETTR 1.0. Time over steps is the mean."""
    step_done, t = [], 0.0
    for step in range(1, 601):
        t += 0.16 + (0.5 if step % 10 == 0 else 0.0)
        step_done.append(t)
    points = [
        LossPoint(step=max(s for s, d in enumerate(step_done, 1) if d <= scrape), loss=3.0,
                  attempt=1, t=float(scrape))
        for scrape in range(1, int(t))
    ]  # fmt: skip
    mean = (step_done[-1] - step_done[0]) / (len(step_done) - 1)
    assert mean_step_seconds(points) == pytest.approx(mean, rel=0.02)


def _with_eval() -> Report:
    points = [(10, 6.5, 1), (20, 6.0, 1), (30, math.nan, 2)]
    evals = [LossPoint(s, x, a, at(s).timestamp(), "eval") for s, x, a in points]
    return build_report(dataclasses.replace(scenario(), eval_loss=evals))


def test_validation_loss_is_listed_and_round_trips() -> None:
    report = _with_eval()
    assert [(p.step, p.loss) for p in report.eval_loss] == [(10, 6.5), (20, 6.0)]  # NaN: none
    text = render_text(report)
    assert "Validation loss" in text
    line = "  attempt 1: 2 at steps 10-20, first 6.5000, best 6.0000 (step 20), last 6.0000\n"
    assert line in text
    again = Report.from_dict(json.loads(report.to_json()))
    assert again.eval_loss == report.eval_loss
    assert "Validation loss" not in render_text(build_report(scenario()))


def test_eval_points_come_from_rank_0s_eval_lines() -> None:
    from supervisor.run_logs import _step_points

    line = '{{"ts": {t}, "event": "{e}", "rank": {r}, "step": {s}, "loss": {x}}}'
    text = "\n".join(
        [
            line.format(t=1.0, e="eval", r=0, s=4, x=5.5),
            line.format(t=1.0, e="eval", r=1, s=4, x=5.5),  # the same value, another rank
            line.format(t=2.0, e="step", r=0, s=5, x=7.0),
            "not json",
            line.format(t=3.0, e="eval", r=0, s=8, x=5.25),
        ]
    )
    evals = _step_points(text, attempt=2, event="eval")
    assert [(p.step, p.loss, p.attempt, p.t, p.source) for p in evals] == [
        (4, 5.5, 2, 1.0, "eval"),
        (8, 5.25, 2, 3.0, "eval"),
    ]
    assert [(p.step, p.source) for p in _step_points(text, attempt=2)] == [(5, "log")]
