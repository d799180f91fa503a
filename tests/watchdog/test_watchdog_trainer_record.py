"""Findings from the trainer's record of its bad steps (`contracts.anomalies`): exact onsets,
exact skips, contained faults left alone, the budget stop, and the trainer's own judgement."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from watchdog_curves import Faults, simulate, snapshot

from contracts.anomalies import (
    CLEAN,
    NONFINITE,
    SPIKE,
    STOP,
    STRAGGLER,
    Anomaly,
    merge_ranges,
    parse,
    ranges_of,
)
from contracts.spec import RecoverySpec
from megatron_runs.anomaly import (
    MIN_TREND_STEPS,
    LossTrend,
    SkipBudget,
    StepOutcome,
    StragglerWatch,
    clean_record,
    judge,
    node_busy,
    severe_steps,
    straggler_record,
)
from supervisor.metrics_in import MetricSample
from supervisor.models import AttemptState
from supervisor.watchdog.detectors import (
    contained,
    detect_all,
    detect_grad_explosion,
    detect_loss_spike,
    detect_nonfinite,
    detect_skip_budget,
    detect_trainer_anomalies,
    unremedied_spikes,
)
from supervisor.watchdog.policy import decide, skip_ranges
from supervisor.watchdog.snapshot import (
    Cause,
    CheckpointRef,
    FindingKind,
    PastRemedy,
    RemedyKind,
    RunHistory,
    Snapshot,
)

NODES = ("n1", "n2")


def _samples(upto: int, loss: float = 5.0, nonfinite_total: float = 0.0) -> list[MetricSample]:
    return [
        MetricSample(
            t=1000.0 + s,
            step=s,
            loss=loss,
            loss_window_max=loss,
            loss_window_min=loss,
            grad_norm=1.0,
            grad_norm_window_max=1.0,
            nonfinite_total=nonfinite_total,
            samples_consumed=8 * s,
            last_step_ts=1000.0 + s,
            tokens_per_second=100.0,
        )
        for s in range(1, upto + 1)
    ]


def _snap(records: list[Anomaly], upto: int, **kw: object) -> Snapshot:
    snap = snapshot(_samples(upto, **kw), nodes=NODES)  # type: ignore[arg-type]
    return dataclasses.replace(snap, anomalies=tuple(records))


def spike(step: int, samples: tuple[tuple[int, int], ...], attempt: int = 1) -> Anomaly:
    return Anomaly(
        attempt,
        step,
        SPIKE,
        samples,
        consumed=(8 * step - 8, 8 * step),
        loss=50.0,
        threshold=10.0,
        t=1000.0 + step,
    )


def nan(
    step: int,
    samples: list[tuple[int, int]] | tuple[()] = (),
    nodes: list[str] | tuple[str, ...] = (),
    attempt: int = 1,
) -> Anomaly:
    return Anomaly(
        attempt,
        step,
        NONFINITE,
        tuple(samples),
        tuple(nodes),
        consumed=(8 * step - 8, 8 * step),
        update_skipped=True,
        t=1000.0 + step,
    )


def clean(step: int, attempt: int = 1) -> Anomaly:
    return Anomaly(attempt, step, CLEAN, consumed=(8 * step - 8, 8 * step), t=1000.0 + step)


HISTORY = RunHistory(
    checkpoints=(CheckpointRef(10, 0.0), CheckpointRef(20, 0.0), CheckpointRef(30, 0.0)),
    attempt_nodes=NODES,
)


def test_a_spike_episode_is_judged_once_over_and_skips_exactly_its_samples(
    rc: RecoverySpec,
) -> None:
    records = [spike(29, ((229, 232),)), spike(30, ((232, 240),)), spike(31, ((240, 243),))]
    # Step 31 is the newest the metrics show: the episode may go on, so no verdict yet.
    assert detect_trainer_anomalies(_snap(records, 31), rc) == []
    (f,) = detect_trainer_anomalies(_snap(records, 33), rc)
    assert (f.kind, f.cause) == (FindingKind.LOSS_SPIKE, Cause.DATA)
    assert (f.last_healthy_step, f.first_bad_step) == (28, 29)
    assert f.bad_samples == ((229, 243),) and f.sample_window == (229, 243)
    remedy = decide(_snap(records, 33), [f], HISTORY, rc)
    assert remedy.kind is RemedyKind.ROLLBACK and remedy.to_step == 20
    assert remedy.skip_ranges == ((229, 243),)  # the window, not [rollback, detection)
    margin = RecoverySpec(skip_margin_samples=4)
    assert skip_ranges(f, margin, 8) == ((229, 247),)


def test_the_trainers_clean_line_ends_an_episode_before_a_scrape_shows_a_later_step(
    rc: RecoverySpec,
) -> None:
    records = [spike(29, ((229, 232),)), spike(30, ((232, 240),)), spike(31, ((240, 243),))]
    # The metrics still show step 31 only; the trainer's line for step 32 says it came clean.
    (f,) = detect_trainer_anomalies(_snap([*records, clean(32)], 31), rc)
    assert f.bad_samples == ((229, 243),)  # the window alone: no rollback_skip_steps added
    # A clean line of an earlier episode ends nothing after it.
    assert detect_trainer_anomalies(_snap([clean(28), *records], 31), rc) == []
    nans = [nan(40, nodes=NODES), nan(41, nodes=NODES)]
    assert contained(_snap(nans, 41, nonfinite_total=2.0), rc) == []
    assert len(contained(_snap([*nans, clean(42)], 41, nonfinite_total=2.0), rc)) == 1


def test_a_spike_episode_over_because_the_job_ended_is_judged(rc: RecoverySpec) -> None:
    records = [spike(29, ((224, 232),))]
    snap = dataclasses.replace(
        _snap(records, 29),
        job=dataclasses.replace(_snap([], 29).job, state=AttemptState.FAILED, exit_code=1),
    )
    assert [f.first_bad_step for f in detect_trainer_anomalies(snap, rc)] == [29]


def test_the_scrape_based_detectors_defer_to_the_trainers_record(rc: RecoverySpec) -> None:
    high = _samples(31)
    high[-3:] = [dataclasses.replace(s, loss=80.0, loss_window_max=80.0) for s in high[-3:]]
    snap = dataclasses.replace(snapshot(high, nodes=NODES), anomalies=(spike(29, ((224, 232),)),))
    assert detect_loss_spike(dataclasses.replace(snap, anomalies=()), rc) != []
    assert detect_loss_spike(snap, rc) == []
    # The spike's gradients too: a grad-norm explosion over the same steps is its business.
    steep = [dataclasses.replace(s, grad_norm=50.0, grad_norm_window_max=50.0) for s in high[-3:]]
    exploding = dataclasses.replace(snap, metrics=dataclasses.replace(
        snap.metrics, samples=(*high[:-3], *steep)))  # fmt: skip
    assert detect_grad_explosion(dataclasses.replace(exploding, anomalies=()), rc) != []
    assert detect_grad_explosion(exploding, rc) == []
    # Non-finite steps the record names are its business too; unnamed ones are not.
    counted = _snap([nan(12, [(88, 96)])], 14, nonfinite_total=1.0)
    assert detect_nonfinite(counted, rc) == []
    assert detect_nonfinite(dataclasses.replace(counted, anomalies=()), rc) != []


def test_nan_batches_under_the_budget_are_contained_and_taken_no_action_on(
    rc: RecoverySpec,
) -> None:
    # A NaN sample makes its data rank's node's gradients NaN: that blames the data, not it.
    records = [nan(33, [(256, 264)], ["n1"]), nan(34, [(264, 268)], ["n1"])]
    snap = _snap(records, 36, nonfinite_total=2.0)
    assert detect_all(snap, rc) == []
    (episode,) = contained(snap, rc)
    assert (episode.first, episode.last, episode.samples) == (33, 34, ((256, 268),))


def test_a_node_that_makes_nan_again_is_excluded_and_a_single_strike_contained(
    rc: RecoverySpec,
) -> None:
    once = _snap([nan(40, nodes=["n2"])], 42, nonfinite_total=1.0)
    assert detect_all(once, rc) == [] and len(contained(once, rc)) == 1
    twice = _snap([nan(40, nodes=["n2"]), nan(45, nodes=["n2"])], 46, nonfinite_total=2.0)
    (f,) = detect_all(twice, rc)
    assert (f.kind, f.cause, f.nodes, f.first_bad_step) == (
        FindingKind.NONFINITE, Cause.NODE, ("n2",), 40,
    )  # fmt: skip
    assert contained(twice, rc) == []
    assert decide(twice, [f], HISTORY, rc).exclude_nodes == ("n2",)
    # Every node of the job making NaN singles none out: contained, not an exclusion.
    both = _snap([nan(40, nodes=NODES), nan(41, nodes=NODES)], 42, nonfinite_total=2.0)
    assert detect_all(both, rc) == []


@pytest.mark.parametrize(
    ("records", "cause", "nodes", "skips"),
    [
        ([nan(6, [(40, 48)]), nan(7, [(48, 56)]), nan(8, [(56, 64)])], Cause.DATA, (), ((40, 64),)),
        ([nan(6, nodes=["n2"]), nan(7, nodes=["n2"])], Cause.NODE, ("n2",), ()),
        ([nan(6), nan(7)], Cause.DATA, (), ((40, 56),)),  # nothing singled out: their batches
    ],
    ids=["data", "node", "unexplained"],
)
def test_the_trainers_budget_stop_names_its_cause(
    rc: RecoverySpec,
    records: list[Anomaly],
    cause: Cause,
    nodes: tuple[str, ...],
    skips: tuple[tuple[int, int], ...],
) -> None:
    last = records[-1]
    stop = dataclasses.replace(last, kind=STOP, skipped_updates=len(records), window_steps=100)
    snap = _snap([*records, stop], last.step)
    snap = dataclasses.replace(
        snap, job=dataclasses.replace(snap.job, state=AttemptState.FAILED, exit_code=79)
    )
    findings = detect_all(snap, rc)
    f = findings[0]  # first: before the job's failure
    assert (f.kind, f.cause, f.nodes, f.bad_samples) == (FindingKind.NONFINITE, cause, nodes, skips)
    assert detect_skip_budget(snap, rc) == [f] and contained(snap, rc) == []
    remedy = decide(snap, findings, HISTORY, rc)
    assert remedy.kind is (RemedyKind.EXCLUDE_NODE if nodes else RemedyKind.ROLLBACK)
    if not nodes:
        assert remedy.skip_ranges == skips and remedy.to_step == 0


def test_a_node_tipping_a_budget_a_contained_nan_batch_began_is_dated_by_its_own_strikes(
    rc: RecoverySpec,
) -> None:
    """Seed 16: a NaN batch at steps 29-30 (contained), then n2's NaN at 64-65 exceeded the
    budget of 3. The node is to blame, from step 64: resuming from before 29 loses 35 steps."""
    records = [nan(29, [(224, 232)], ["n1"]), nan(30, [(232, 240)], ["n1"])]
    records += [nan(64, nodes=["n2"]), nan(65, nodes=["n2"])]
    stop = dataclasses.replace(records[-1], kind=STOP, skipped_updates=4, window_steps=100)
    snap = _snap([*records, stop], 65)
    (f, *_) = detect_all(snap, rc)
    assert (f.cause, f.nodes, f.first_bad_step, f.last_healthy_step) == (
        Cause.NODE,
        ("n2",),
        64,
        63,
    )
    remedy = decide(snap, [f], HISTORY, rc)
    assert remedy.kind is RemedyKind.EXCLUDE_NODE and remedy.to_step == 30


def test_a_nan_episode_still_going_on_is_not_contained_yet(rc: RecoverySpec) -> None:
    going = _snap([nan(40, nodes=NODES), nan(41, nodes=NODES)], 41, nonfinite_total=2.0)
    assert contained(going, rc) == []  # it may yet end in the trainer's budget stop
    assert len(contained(_snap(list(going.anomalies), 42, nonfinite_total=2.0), rc)) == 1


def test_a_one_node_jobs_nan_gradients_are_skipped_once_then_its_node_excluded(
    rc: RecoverySpec,
) -> None:
    """Finite losses, NaN gradients, one node: nothing singles the node out, so the first
    budget stop rolls back past those steps' batches (data first); when it recurs after that
    skip, the backward pass is suspected: the node common to both attempts is excluded."""
    records = [nan(s, nodes=["n1"]) for s in (8, 9, 10, 11)]
    stop = dataclasses.replace(records[-1], kind=STOP, skipped_updates=4, window_steps=100)
    one_node = dataclasses.replace(
        _snap([*records, stop], 11),
        job=dataclasses.replace(
            _snap([], 11).job, nodes=("n1",), state=AttemptState.FAILED, exit_code=79
        ),
    )
    history = dataclasses.replace(HISTORY, attempt_nodes=("n1",))
    (f, *_) = detect_all(one_node, rc)
    assert (f.cause, f.nodes, f.evidence["grads_only"]) == (Cause.DATA, (), True)
    first = decide(one_node, [f], history, rc)
    assert first.kind is RemedyKind.ROLLBACK and first.skip_ranges == ((56, 88),)
    past = PastRemedy(
        RemedyKind.ROLLBACK, 1, one_node.now - 5, FindingKind.NONFINITE, step=11,
        skip_ranges=first.skip_ranges, attempt_nodes=("n1",),
    )  # fmt: skip
    again = decide(
        dataclasses.replace(one_node, attempt=2), [f],
        dataclasses.replace(history, remedies=(past,)), rc,
    )  # fmt: skip
    assert again.kind is RemedyKind.EXCLUDE_NODE and again.exclude_nodes == ("n1",)


def test_a_tolerated_spike_is_contained_once_over_and_a_longer_one_is_not(
    rc: RecoverySpec,
) -> None:
    lenient = RecoverySpec(tolerate_spike_steps=1)
    one = _snap([spike(29, ((224, 232),))], 31)
    assert detect_trainer_anomalies(one, lenient) == []
    assert [e.first for e in contained(one, lenient)] == [29]
    assert unremedied_spikes(one, lenient) == [] and len(unremedied_spikes(one, rc)) == 1
    two = _snap([spike(29, ((224, 232),)), spike(30, ((232, 240),))], 31)
    assert len(detect_trainer_anomalies(two, lenient)) == 1 and contained(two, lenient) == []


# -- the trainer's own judgement (megatron_runs.anomaly) -------------------------------------


def _outcome(
    step: int, losses: list[float], skipped: bool = False, nodes: tuple[str, ...] = ()
) -> StepOutcome:
    idx = list(range(8 * step - 8, 8 * step))
    finite = [x for x in losses if math.isfinite(x)]
    loss = sum(losses) / len(losses) if len(finite) == len(losses) else math.nan
    return StepOutcome(step, loss, idx, losses, skipped, tuple(nodes), 8 * step)


def test_the_trainer_names_nonfinite_and_spiking_samples_and_learns_only_from_good_steps(
    rc: RecoverySpec,
) -> None:
    trend = LossTrend(rc.loss_spike_window)
    for step in range(1, MIN_TREND_STEPS):  # too few good steps yet: even a huge loss passes
        assert judge(_outcome(step, [7.0 - 0.01 * step] * 8), trend, rc, 1, 0.0) is None
    huge = _outcome(MIN_TREND_STEPS, [7.0] * 7 + [500.0])
    assert judge(huge, trend, rc, 1, 0.0) is None  # it was the 8th good step: trend full now
    bad = judge(_outcome(10, [7.0] * 5 + [160.0] * 3), trend, rc, 1, 0.0)
    assert bad is not None and bad.kind == SPIKE and bad.samples == ((77, 80),)
    assert len(trend.losses) == MIN_TREND_STEPS  # the spike did not join the trend
    worse = judge(_outcome(11, [7.0] * 6 + [math.nan, 7.0], skipped=True), trend, rc, 1, 0.0)
    assert worse is not None and worse.kind == NONFINITE and worse.samples == ((86, 87),)
    node = judge(_outcome(12, [7.0] * 8, skipped=True, nodes=("n2",)), trend, rc, 1, 0.0)
    assert node is not None and node.samples == () and node.nodes == ("n2",)
    over = clean_record(_outcome(13, [7.0] * 8), 1, 5.0)  # the good step after them
    assert (over.kind, over.step, over.consumed, over.samples) == (CLEAN, 13, (96, 104), ())


def test_the_skip_budget_counts_within_its_window() -> None:
    budget = SkipBudget(budget=2, window=10)
    assert [budget.add(s) for s in (1, 5, 11, 12)] == [False, False, False, True]


def test_records_round_trip_and_a_torn_last_line_waits() -> None:
    rec = nan(3, [(16, 24)], ["n1"])
    text = rec.to_json() + "\n" + spike(4, ((24, 26),)).to_json()  # the second line is torn
    assert parse(text) == [rec]
    assert merge_ranges([(5, 8), (0, 2), (2, 3), (9, 9)]) == ((0, 3), (5, 8))
    assert ranges_of([4, 1, 2, 3, 9]) == ((1, 5), (9, 10))


def _judged(losses: list[float], rc: RecoverySpec, spread: float = 0.3) -> list[Anomaly]:
    """Every step of a run judged as the trainer does, its 8 samples spread ±`spread` about
    the step's loss (their mean is the step's loss)."""
    trend, out = LossTrend(rc.loss_spike_window), []
    offsets = [spread * (2 * i / 7 - 1) for i in range(8)]
    for step, loss in enumerate(losses, start=1):
        sample_losses = [loss * (1 + o) for o in offsets]
        bad = judge(_outcome_of(step, sample_losses), trend, rc, 1, 0.0)
        if bad is not None:
            out.append(bad)
    return out


def _outcome_of(step: int, sample_losses: list[float]) -> StepOutcome:
    idx = list(range(8 * step - 8, 8 * step))
    return StepOutcome(step, sum(sample_losses) / 8, idx, sample_losses, False, (), 8 * step)


def test_the_trainer_flags_no_step_of_noisy_healthy_runs_and_every_step_of_a_spike(
    rc: RecoverySpec,
) -> None:
    """60 seeded healthy curves (trend + heavy-tailed noise), all 400 steps from the first:
    nothing flagged. The same curves with a spike (× 6 for 3 steps): exactly those steps."""
    for seed in range(60):
        healthy = [s.loss for s in simulate(seed, steps=400, steps_per_sample=1)]
        assert _judged(healthy, rc) == [], seed  # type: ignore[arg-type]
        spiked = simulate(seed, steps=400, steps_per_sample=1, faults=Faults(spike_steps=(20, 23)))
        flagged = _judged([s.loss for s in spiked], rc)  # type: ignore[misc]
        assert [a.step for a in flagged] == [20, 21, 22], seed
        assert flagged[0].samples == ((152, 160),)  # all 8 of its samples are above


def _named(watch: StragglerWatch, series: list[dict[str, float]]) -> list[tuple[int, str]]:
    return [(step, node) for step, busy in enumerate(series, 1) for node in watch.observe(busy)]


def test_a_severe_straggler_is_named_after_a_third_of_the_window() -> None:
    """n2 steps 3.95× slower from step 21 (above twice the others): named at step 25, its 5th
    slow step in a row, judged over those 5; a normal step among them starts the count again;
    1.9× waits for the majority (step 29, over 16)."""
    normal = {"n1": 0.07, "n2": 0.07, "n3": 0.07}
    severe = {**normal, "n2": 0.07 * 3.95}
    watch = StragglerWatch(ratio=1.5, steps=16)
    found = {}
    for step, busy in enumerate([normal] * 20 + [severe] * 40, 1):
        found.update({(step, n): v for n, v in watch.observe(busy).items()})
    assert list(found) == [(25, "n2")] and found[(25, "n2")] == (pytest.approx(3.95), 5)
    broken = [normal] * 20 + [severe] * 3 + [normal] + [severe] * 40  # the majority: step 30
    assert _named(StragglerWatch(1.5, 16), broken) == [(29, "n2")]
    # a normal step after it was named does not end the episode: named once
    gap = [normal] * 20 + [severe] * 5 + [normal] + [severe] * 10
    assert _named(StragglerWatch(1.5, 16), gap) == [(25, "n2")]
    mild = {**normal, "n2": 0.07 * 1.9}
    assert _named(StragglerWatch(1.5, 16), [normal] * 20 + [mild] * 40) == [(29, "n2")]
    assert severe_steps(16) == 5 and severe_steps(8) == 4


def test_the_trainer_names_a_straggler_once_it_was_slow_in_more_than_half_its_window() -> None:
    """n2 steps 1.9× slower from step 21: named at step 29, its 9th slow step of 16, once;
    named again only after an episode of health in between."""
    normal = {"n1": 0.07, "n2": 0.07, "n3": 0.07}
    slow = {**normal, "n2": 0.133}
    watch = StragglerWatch(ratio=1.5, steps=16)
    assert _named(watch, [normal] * 20 + [slow] * 40) == [(29, "n2")]
    assert watch.observe(slow) == {}
    named = _named(watch, [normal] * 8 + [slow] * 9)  # 8 of 16 slow: re-armed, then 9 again
    assert named == [(17, "n2")]
    # A one-node job has nobody to be slower than; eight slow steps of 16 are not enough.
    assert _named(StragglerWatch(1.5, 16), [{"n1": 1.0}] * 40) == []
    assert _named(StragglerWatch(1.5, 16), [normal] * 8 + [slow] * 8 + [normal] * 8) == []


def _noisy_busy(rng: random.Random) -> float:
    t = 0.07 * rng.lognormvariate(0, 0.15)
    return t * rng.uniform(1, 5) if rng.random() < 0.05 else t


def test_the_trainer_names_no_node_of_noisy_healthy_runs() -> None:
    """60 seeded runs of 2,000 steps on 2 and 4 nodes: heavy-tailed noise on every node's
    step (lognormal, and one step in 20 of a node stalled 1-5× by something else on the
    host): no node is named. The same runs with one node 2× slower from step 1,000 (slow
    steps noisy too): that node alone, first within the window."""
    for seed in range(60):
        rng = random.Random(seed)
        nodes = [f"n{i}" for i in range(2 + 2 * (seed % 2))]
        healthy = [{n: _noisy_busy(rng) for n in nodes} for _ in range(2000)]
        assert _named(StragglerWatch(1.5, 16), healthy) == [], seed
        bad = nodes[seed % len(nodes)]
        slowed = [
            {n: _noisy_busy(rng) * (2.0 if n == bad and s >= 1000 else 1.0) for n in nodes}
            for s in range(2000)
        ]
        named = _named(StragglerWatch(1.5, 16), slowed)
        assert {node for _, node in named} == {bad} and 1000 < named[0][0] <= 1016, seed


def test_a_nodes_step_time_is_its_slowest_ranks() -> None:
    assert node_busy([0.1, 0.3, 0.2, 0.1], [0, 0, 1, 1], ["n1", "n2"]) == {"n1": 0.3, "n2": 0.2}


def test_a_straggler_the_trainer_named_is_excluded_while_its_job_runs(rc: RecoverySpec) -> None:
    record = straggler_record(130, "n2", 2.84, 16, attempt=1, now=1130.0)
    assert parse(record.to_json() + "\n") == [record]
    (f,) = detect_trainer_anomalies(_snap([record], 131), rc)
    assert (f.kind, f.cause, f.nodes, f.first_bad_step, f.evidence["ratio"]) == (
        FindingKind.STRAGGLER, Cause.NODE, ("n2",), 115, 2.84,
    )  # fmt: skip
    assert decide(_snap([record], 131), [f], HISTORY, rc).exclude_nodes == ("n2",)
    ended = dataclasses.replace(
        _snap([record], 131),
        job=dataclasses.replace(_snap([], 131).job, state=AttemptState.FAILED, exit_code=1),
    )
    assert [f for f in detect_trainer_anomalies(ended, rc) if f.kind is FindingKind.STRAGGLER] == []
    assert record.kind == STRAGGLER
