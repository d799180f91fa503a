"""Detectors on synthetic telemetry: quiet on noisy healthy runs, loud on each fault shape."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest
from watchdog_curves import GLOBAL_BATCH, Faults, simulate, snapshot

from contracts.spec import RecoverySpec
from supervisor.metrics_in import DARK_AFTER_S, MetricSample, MetricsView, SourceHealth
from supervisor.models import AttemptState
from supervisor.watchdog.blame import classify_failure
from supervisor.watchdog.detectors import (
    by_step,
    detect_all,
    detect_checkpoint_problems,
    detect_grad_explosion,
    detect_hang,
    detect_job_state,
    detect_loss_spike,
    detect_nonfinite,
    detect_replica_mismatch,
    detect_startup_hang,
    detect_straggler,
    detect_throughput_drop,
    hang_due,
    hang_probe_at,
    startup_limit,
    straggler_due,
    verdict_due,
)
from supervisor.watchdog.detectors.progress import (
    SAMPLE_SETTLE,
    STARTUP_MIN_S,
    next_read,
    unseen_host_s,
)
from supervisor.watchdog.policy import rollback_target
from supervisor.watchdog.snapshot import Cause, CheckpointRef, FindingKind, RunHistory


@pytest.mark.parametrize("steps_per_sample", [1, 3, 7])
def test_noisy_healthy_runs_produce_no_finding(rc: RecoverySpec, steps_per_sample: int) -> None:
    """Every prefix of 60 seeded healthy runs (trend + heavy-tailed noise) is judged healthy."""
    for seed in range(60):
        samples = simulate(seed, steps=400, steps_per_sample=steps_per_sample)
        for end in range(10, len(samples) + 1, 5):
            findings = detect_all(snapshot(samples[:end]), rc)
            assert findings == [], (seed, end, findings)


def test_sustained_spike_found_with_onset_bounded_by_last_healthy_sample(
    rc: RecoverySpec,
) -> None:
    for seed in range(20):
        samples = simulate(seed, steps=300, faults=Faults(spike_steps=(201, 260)))
        upto = [s for s in samples if s.step is not None and s.step <= 210]
        findings = detect_loss_spike(snapshot(upto), rc)
        assert len(findings) == 1, seed
        f = findings[0]
        assert f.kind is FindingKind.LOSS_SPIKE and f.cause is Cause.DATA
        assert f.last_healthy_step is not None and f.first_bad_step is not None
        assert f.last_healthy_step < 201 <= f.first_bad_step
        lo, hi = f.sample_window  # type: ignore[misc]
        # The bad step's samples lie inside the window that a rollback would skip.
        assert lo <= 200 * GLOBAL_BATCH < hi
        assert f.evidence["elevated_steps"] >= rc.loss_spike_sustain_steps
        assert f.evidence["threshold"] > f.evidence["baseline_median"]


def test_transient_single_step_spike_is_not_sustained(rc: RecoverySpec) -> None:
    samples = simulate(3, steps=300, steps_per_sample=1, faults=Faults(spike_steps=(200, 201)))
    for end in range(150, 230):
        assert detect_loss_spike(snapshot(samples[:end]), rc) == []


def test_spike_between_scrapes_counts_its_real_length_via_window_min(rc: RecoverySpec) -> None:
    """Scrapes every 16 steps: the window minimum shows all 16 steps were high."""
    samples = simulate(5, steps=640, steps_per_sample=16, faults=Faults(spike_steps=(513, 600)))
    upto = [s for s in samples if (s.step or 0) <= 544]
    (f,) = detect_loss_spike(snapshot(upto), rc)
    assert f.last_healthy_step == 512 and f.first_bad_step == 528


@pytest.mark.parametrize(
    ("steps_per_sample", "factor"), [(7, 6.0), (8, 6.0), (8, 25.0), (9, 25.0), (12, 25.0)]
)
def test_spike_early_in_a_run_is_found_when_scrapes_are_sparse(
    rc: RecoverySpec, steps_per_sample: int, factor: float
) -> None:
    """The demo's flake: 8-12 steps a scrape leave only 2-4 samples before a 24-step spike
    at step 36, yet through the window gauges they watched every step, enough for a
    baseline. The spike is found while it lasts (a 25x one, as the demo's poison, by the
    hard rule)."""
    spike = (36, 60)
    for seed in range(10):
        samples = simulate(
            seed,
            steps=80,
            steps_per_sample=steps_per_sample,
            faults=Faults(spike_steps=spike, spike_factor=factor),
        )
        upto = [s for s in samples if (s.step or 0) < spike[1]]
        (f,) = detect_loss_spike(snapshot(upto), rc)
        assert f.last_healthy_step is not None and f.first_bad_step is not None
        assert f.last_healthy_step < spike[0] <= f.first_bad_step, seed


def test_spike_that_resolved_itself_is_not_reported(rc: RecoverySpec) -> None:
    samples = simulate(8, steps=400, steps_per_sample=1, faults=Faults(spike_steps=(200, 206)))
    upto = [s for s in samples if (s.step or 0) <= 260]
    assert detect_loss_spike(snapshot(upto), rc) == []


def test_nonfinite_found_once_and_onset_bounded(rc: RecoverySpec) -> None:
    samples = simulate(1, steps=300, steps_per_sample=4, faults=Faults(nan_from=150))
    upto = [s for s in samples if (s.step or 0) <= 152]
    (f,) = detect_nonfinite(snapshot(upto), rc)
    assert f.kind is FindingKind.NONFINITE
    assert f.last_healthy_step == 148 and f.first_bad_step == 152
    assert f.sample_window == (148 * GLOBAL_BATCH, 152 * GLOBAL_BATCH)
    assert f.evidence["loss"] == "nan"


def test_nan_grads_are_pinned_on_the_node_whose_own_gradients_went_bad(
    rc: RecoverySpec,
) -> None:
    """n2's counter of non-finite local gradients names it; the loss stayed finite. Bad data
    (every node's gradients) or a one-node job names no node: a data finding as before."""
    samples = simulate(1, steps=300, faults=Faults(nan_from=150, nan_grads_only=True))
    upto = [s for s in samples if (s.step or 0) <= 152]
    (f,) = detect_nonfinite(snapshot(upto, nonfinite_grad_nodes=("n2",)), rc)
    assert f.nodes == ("n2",) and f.cause is Cause.NODE and f.evidence["grads_only"]
    assert f.last_healthy_step is not None and f.last_healthy_step < 150
    everyone = snapshot(upto, nonfinite_grad_nodes=("n1", "n2", "n3"))
    (g,) = detect_nonfinite(dataclasses.replace(everyone, now=upto[-1].t + 60), rc)
    assert g.nodes == () and g.cause is Cause.DATA
    alone = snapshot(upto, nodes=("n2",), nonfinite_grad_nodes=("n2",))
    (h,) = detect_nonfinite(alone, rc)
    assert h.nodes == () and h.cause is Cause.DATA


def test_nan_grads_wait_a_scrape_for_their_node_then_act_without_it(rc: RecoverySpec) -> None:
    """Each node's counter is scraped on its own schedule, so the node may be named a scrape
    after the primary shows the NaN: a grads-only NaN waits up to the attribution wait."""
    samples = simulate(1, steps=300, faults=Faults(nan_from=150, nan_grads_only=True))
    upto = [s for s in samples if (s.step or 0) <= 152]
    first_bad = next(s for s in upto if s.nonfinite_total)
    young = snapshot(upto, now=first_bad.t + 1.0)
    assert detect_nonfinite(young, rc) == []
    (f,) = detect_nonfinite(snapshot(upto, now=first_bad.t + rc.nan_attribution_wait_seconds), rc)
    assert f.cause is Cause.DATA and f.nodes == ()
    eager = rc.model_copy(update={"nan_attribution_wait_seconds": 0.0})
    assert len(detect_nonfinite(young, eager)) == 1


def test_nonfinite_before_the_first_scrape_is_dated_by_the_counter(rc: RecoverySpec) -> None:
    """An attempt first scraped well after its NaN began (a new target waits for Prometheus's
    discovery): the non-finite counter, not the first step seen bad, bounds the onset, so a
    rollback resumes before it."""
    samples = simulate(1, steps=40, steps_per_sample=1, faults=Faults(nan_from=8))
    late = [s for s in samples if s.step == 19]  # the first scrape: 12 NaN steps, 8..19
    (f,) = detect_nonfinite(snapshot(late), rc)
    assert f.last_healthy_step is None and f.first_bad_step == 8
    ckpts = tuple(CheckpointRef(step=s, saved_at=0.0) for s in (5, 10, 15))
    assert rollback_target(f, RunHistory(checkpoints=ckpts)) == 5
    # A scrape torn between the NaN gauge and the counter's increment bounds by its own step.
    torn = dataclasses.replace(late[0], nonfinite_total=0.0)
    assert detect_nonfinite(snapshot([torn]), rc)[0].first_bad_step == 19


def test_grad_explosion_needs_sustain(rc: RecoverySpec) -> None:
    samples = simulate(2, steps=300, steps_per_sample=1, faults=Faults(grad_from=250))
    assert detect_grad_explosion(snapshot(samples[:251]), rc) == []
    (f,) = detect_grad_explosion(snapshot(samples[:253]), rc)
    assert f.first_bad_step == 250 and f.last_healthy_step == 249


#: A 1.3B GPT's first gradient norms from scratch on an H200 (bf16, LR warmup 5 steps), then
#: the same norms as an episode after 40 healthy steps.
FIRST_NORMS = (52.65, 44.13, 34.45, 4.32, 16.37)


def _norms(norms: Sequence[float], first_step: int = 1) -> list[MetricSample]:
    """One sample a step, each window reaching back to the step before (scrapes between)."""
    return [
        MetricSample(t=1000.0 + i, step=first_step + i, last_step_ts=1000.0 + i, loss=9.0,
                     grad_norm=n, grad_norm_window_max=max(n, norms[i - 1] if i else n))
        for i, n in enumerate(norms)
    ]  # fmt: skip


def test_a_runs_first_high_norms_are_its_initial_transient_not_an_explosion(
    rc: RecoverySpec,
) -> None:
    assert detect_grad_explosion(snapshot(_norms(FIRST_NORMS)), rc) == []
    late = _norms([3.0] * 40 + list(FIRST_NORMS))
    (f,) = detect_grad_explosion(snapshot(late), rc)
    assert (f.last_healthy_step, f.first_bad_step) == (40, 41)
    # high from the start, but past the settling steps (and the warmup): an explosion
    assert detect_grad_explosion(snapshot(_norms(FIRST_NORMS, first_step=11)), rc) != []
    longer_warmup = dataclasses.replace(snapshot(_norms(FIRST_NORMS, first_step=11)),
                                        warmup_steps=20)  # fmt: skip
    assert detect_grad_explosion(longer_warmup, rc) == []


def test_throughput_drop(rc: RecoverySpec) -> None:
    samples = simulate(4, steps=200, steps_per_sample=2, faults=Faults(slow_from=180))
    assert detect_throughput_drop(snapshot(samples[:89]), rc) == []
    (f,) = detect_throughput_drop(snapshot(samples), rc)
    assert f.evidence["baseline"] > 2 * f.evidence["tokens_per_second"][-1]


def test_straggler_names_the_slow_node(rc: RecoverySpec) -> None:
    samples = simulate(6, steps=60, faults=Faults(straggler="n2"))
    (f,) = detect_straggler(snapshot(samples), rc)
    assert f.nodes == ("n2",) and f.cause is Cause.NODE and f.evidence["ratio"] > 1.5


def upto(samples: list[MetricSample], t: float) -> list[MetricSample]:
    """The samples a source had answered with by time `t`."""
    return [x for x in samples if x.t <= t]


def test_hang_uses_median_step_time_with_a_floor(rc: RecoverySpec) -> None:
    samples = simulate(7, steps=200, faults=Faults(hang_at=150), step_seconds=10.0)
    last = samples[-1]
    assert last.step == 150
    hung_for = last.t - last.last_step_ts  # type: ignore[operator]
    # 50 steps × 10 s of silence vs a limit of max(10 × ~10 s, 60 s) = ~100 s.
    (f,) = detect_hang(snapshot(samples), rc)
    assert f.kind is FindingKind.HANG and f.last_healthy_step == 150
    # Every rank stalls in the collective: the job's nodes are evidence, not a blame.
    assert f.nodes == () and f.evidence["job_nodes"] == list(snapshot(samples).job.nodes)
    assert f.evidence["idle_seconds"] > f.evidence["limit_seconds"] >= 90
    assert hung_for > 400
    hung_at = last.last_step_ts
    assert hung_at is not None
    assert detect_hang(snapshot(upto(samples, hung_at + 30)), rc) == []
    # A fast run still gets the 60 s floor.
    fast = simulate(7, steps=1000, faults=Faults(hang_at=90), step_seconds=0.1)
    hung_at = fast[-1].last_step_ts
    assert hung_at is not None
    assert detect_hang(snapshot(upto(fast, hung_at + 59)), rc) == []
    assert detect_hang(snapshot(upto(fast, hung_at + 61)), rc) != []


def test_a_loop_in_a_save_is_judged_by_the_saves_limit(rc: RecoverySpec) -> None:
    """A fast run's first synchronous save outlasts the 60 s floor: busy, not hung, until
    `save_hang_seconds`; a node gone dark meanwhile is judged at the step's limit."""
    fast = simulate(7, steps=1000, faults=Faults(hang_at=90), step_seconds=0.1)
    hung_at = fast[-1].last_step_ts
    assert hung_at is not None

    def in_save(t: float, began: float) -> list[MetricSample]:
        """The samples up to the hang, then one at `t` in the save that began at `began`."""
        before = upto(fast, hung_at + 1)
        return [*before, dataclasses.replace(before[-1], t=t, save_started_ts=began)]

    began = hung_at + 0.01
    assert detect_hang(snapshot(in_save(hung_at + 61, began)), rc) == []
    assert detect_hang(snapshot(in_save(hung_at + rc.save_hang_seconds - 1, began)), rc) == []
    (f,) = detect_hang(snapshot(in_save(hung_at + rc.save_hang_seconds + 1, began)), rc)
    assert f.evidence["saving"] and f.evidence["limit_seconds"] == rc.save_hang_seconds
    # a save that began before the last step is not the one the loop is in now
    assert detect_hang(snapshot(in_save(hung_at + 61, hung_at - 5)), rc) != []
    snap = snapshot(in_save(hung_at + 61, began), dark_nodes=("n2",), peers_steady_s=61)
    (f,) = detect_hang(snap, rc)
    assert f.nodes == ("n2",) and f.evidence["limit_seconds"] < rc.save_hang_seconds


def test_a_save_published_after_the_last_step_is_progress(rc: RecoverySpec) -> None:
    """An exporter starved through a 35 s save (a fresh machine's first, on GPU): the first
    sample after it shows the old step and the new checkpoint. The stall counts from the
    publish, and a hang after it is dated there."""
    fast = simulate(7, steps=1000, faults=Faults(hang_at=90), step_seconds=0.1)
    hung_at = fast[-1].last_step_ts
    assert hung_at is not None
    before = upto(fast, hung_at + 1)
    published = hung_at + 34.7

    def after(t: float) -> list[MetricSample]:
        late = dataclasses.replace(before[-1], t=t, checkpoint_ts=published, checkpoint_step=90)
        return [*before, late]

    assert detect_hang(snapshot(after(hung_at + 35)), rc) == []
    assert detect_hang(snapshot(after(published + rc.hang_floor_seconds - 1)), rc) == []
    (f,) = detect_hang(snapshot(after(published + rc.hang_floor_seconds + 1)), rc)
    assert f.fault_time == published and f.last_healthy_step == 90


def _periodic(hang_step: int, until: float) -> list[MetricSample]:
    """Scrapes exactly 0.25 s apart (Prometheus scrapes a target at a fixed phase) of a run
    stepping every 0.125 s from t=1000 until it hangs after `hang_step`: every time is exact
    in binary, so the times a look is due at compare exactly."""
    samples = []
    for i in range(1, int((until - 1000.0) / 0.25) + 1):
        t = 1000.0 + i * 0.25
        step = min(int((t - 1000.0) / 0.125), hang_step)
        samples.append(
            MetricSample(
                t=t,
                step=step,
                loss=3.0,
                last_step_ts=1000.0 + step * 0.125,
                samples_consumed=8 * step,
                nonfinite_total=0,
            )
        )
    return samples


def test_hang_due_is_when_the_first_sample_past_the_limit_can_be_read(rc: RecoverySpec) -> None:
    """The reconciler ticks at `hang_due`: when the first sample taken past the limit can be
    read (SAMPLE_SETTLE of a scrape after it); a hang on a node that never began the step is
    judged from that very sample, none before it convicts. A hang that names no node waits two
    scrapes more (a frozen host's first timed-out scrape), and the loop looks at each sample as
    it comes until a verdict could come; after that nothing is coming."""
    small = rc.model_copy(update={"hang_floor_seconds": 2.0})  # 10 × 0.125 s is less
    hung_at = 1000.0 + 90 * 0.125
    run = _periodic(90, until=hung_at + 10)
    seen = [x for x in run if x.t <= hung_at + 1]
    settle = SAMPLE_SETTLE * 0.25
    due = hang_due(snapshot(seen), small)
    past_limit = [x.t for x in run if x.t > hung_at + 2.0]
    assert due == past_limit[0] + settle

    def convicting(**named: tuple[str, ...]) -> float:
        return next(x.t for x in run if detect_hang(snapshot(upto(run, x.t), **named), small) != [])

    assert convicting(lagging_nodes=("n3",)) == past_limit[0]
    # A run that has shown a 1 s gap between steps: 3 × that is the limit.
    gapped = [dataclasses.replace(x, step_gap_max=1.0) for x in seen]
    assert (
        hang_due(snapshot(gapped), small)
        == next(t for t in past_limit if t > hung_at + 3.0) + settle
    )
    unseen = unseen_host_s(seen)
    assert unseen == 2 * 0.25
    assert convicting() == next(t for t in past_limit if t > hung_at + 2.0 + unseen)
    late = snapshot(seen, now=due + 0.3)
    assert hang_due(late, small) == next(t for t in past_limit if t > due + 0.3) + settle
    still = snapshot(seen, now=due + unseen + DARK_AFTER_S - 0.01)
    assert hang_due(still, small) == next(t for t in past_limit if t > still.now) + settle
    blind = snapshot(seen, now=due + unseen + DARK_AFTER_S + 0.01)
    assert hang_due(blind, small) is None
    done = snapshot(seen, job_state=AttemptState.COMPLETED)
    assert hang_due(done, small) is None and hang_due(snapshot([]), small) is None
    # The endpoints can be read (probed) the moment the limit runs out, scrape or none.
    last = seen[-1].last_step_ts
    assert hang_probe_at(snapshot(seen), small) == (last + 2.0, last)
    assert hang_probe_at(snapshot(gapped), small) == (last + 3.0, last)
    assert hang_probe_at(done, small) is None and hang_probe_at(snapshot([]), small) is None


def test_the_hang_limit_stays_above_the_longest_gap_the_run_has_shown(rc: RecoverySpec) -> None:
    """With a small floor, the run's own gaps between steps (`step_gap_max`, this attempt's
    or an earlier one's) set the limit: a pause the run came through is not a hang, and a
    hang is judged at hang_gap_factor × the longest, no later."""
    small = rc.model_copy(update={"hang_floor_seconds": 1.5})
    fast = simulate(7, steps=1000, faults=Faults(hang_at=90), step_seconds=0.1)
    hung_at = fast[-1].last_step_ts
    assert hung_at is not None

    def hang(
        samples: list[MetricSample], after: float, prior: list[MetricSample] | None = None
    ) -> list:
        snap = snapshot(upto(samples, hung_at + after), lagging_nodes=("n3",), prior=prior)
        return detect_hang(snap, small)

    # No gap known: the 1.5 s floor (10 × the ~0.1 s step is less).
    assert hang(fast, 1.3) == []
    (f,) = hang(fast, 2)
    assert f.evidence["limit_seconds"] == 1.5 and f.evidence["longest_gap_seen"] is None
    gap = 2.0
    limit = small.hang_gap_factor * gap
    gapped = [dataclasses.replace(x, step_gap_max=gap) for x in fast]
    assert hang(gapped, limit - 0.5) == []
    (f,) = hang(gapped, limit + 0.5)
    assert f.evidence["limit_seconds"] == limit and f.evidence["longest_gap_seen"] == gap
    # An earlier attempt's gap counts as much; a gap not yet measured (NaN, 0) does not.
    earlier = [dataclasses.replace(x, step_gap_max=gap) for x in fast[:5]]
    assert hang(fast, limit - 0.5, prior=earlier) == []
    unknown = [
        dataclasses.replace(x, step_gap_max=math.nan if i % 2 else 0.0) for i, x in enumerate(fast)
    ]
    assert hang(unknown, 2) != []


def test_hang_due_waits_for_a_failing_node_to_settle(rc: RecoverySpec) -> None:
    """While one of the job's nodes fails its scrapes, the verdict waits for it to settle as
    dark (or for the limit + the dark time to pass): the tick is due then, not before."""
    fast = simulate(7, steps=1000, faults=Faults(hang_at=90), step_seconds=0.1)
    hung_at = fast[-1].last_step_ts
    assert hung_at is not None
    snap = snapshot(upto(fast, hung_at + 1), failing_nodes=("n2",))
    plain = hang_due(snapshot(upto(fast, hung_at + 1)), rc)
    assert plain is not None
    later = dataclasses.replace(
        snap, metrics=dataclasses.replace(snap.metrics, dark_settles_at=plain + 3)
    )
    assert hang_due(later, rc) == plain + 3
    sooner = dataclasses.replace(
        snap, metrics=dataclasses.replace(snap.metrics, dark_settles_at=plain - 3)
    )
    assert hang_due(sooner, rc) == plain
    other = dataclasses.replace(
        later, metrics=dataclasses.replace(later.metrics, failing_nodes=("n9",))
    )
    assert hang_due(other, rc) == plain  # not one of the job's nodes


def test_a_hang_is_seen_not_assumed_across_a_blind_spot(rc: RecoverySpec) -> None:
    """Prometheus down 11 s: its first answers after the restart hold the step before it,
    and the 14 s since the last step would convict a healthy node. The silence counts up to
    the newest sample; samples that keep showing it still convict."""
    fast = simulate(7, steps=1700, faults=Faults(hang_at=900), step_seconds=0.1)
    healthy = upto(fast, fast[0].t + 80)  # the last sample before the outage, step ~800
    last = healthy[-1]
    assert last.last_step_ts is not None and last.step < 900
    blind = snapshot(healthy, now=last.t + 70, lagging_nodes=("n3",))
    assert blind.metrics.health is SourceHealth.UP  # within the view's staleness allowance
    assert detect_hang(blind, rc) == []
    hung_at = fast[-1].last_step_ts
    assert hung_at is not None
    (f,) = detect_hang(snapshot(upto(fast, hung_at + 61), lagging_nodes=("n3",)), rc)
    assert f.nodes == ("n3",) and f.evidence["idle_seconds"] > 60


def test_hang_names_the_node_that_never_began_the_step(rc: RecoverySpec) -> None:
    samples = simulate(7, steps=200, faults=Faults(hang_at=150), step_seconds=10.0)
    (f,) = detect_hang(snapshot(samples, lagging_nodes=("n2",)), rc)
    assert f.nodes == ("n2",) and f.evidence["lagging_nodes"] == ["n2"]
    assert f.cause is Cause.NODE and "n2 never began it" in f.summary
    # Behind nobody (all of the job's nodes), or a node not in the job: no blame.
    for lagging in (("n1", "n2", "n3"), ("n9",)):
        (f,) = detect_hang(snapshot(samples, lagging_nodes=lagging), rc)
        assert f.nodes == () and f.cause is Cause.UNKNOWN

    started = samples[-1].t
    stuck = snapshot([], health=SourceHealth.MISSING, now=started + 1000, lagging_nodes=("n3",))
    (f,) = detect_startup_hang(dataclasses.replace(stuck, attempt_started_at=started), rc)
    assert f.nodes == ("n3",) and f.cause is Cause.NODE


def test_hang_blames_a_node_gone_dark_while_its_peers_stood_still(rc: RecoverySpec) -> None:
    """A frozen host: its endpoint fails every scrape and the nodes still answering begin no
    new step. When it exported the run's metrics, the view is STALE and still convicts."""
    samples = simulate(7, steps=200, faults=Faults(hang_at=150), step_seconds=10.0)
    limit = detect_hang(snapshot(samples), rc)[0].evidence["limit_seconds"]

    def hang(health: SourceHealth, dark: tuple[str, ...], steady: float | None) -> list:
        snap = snapshot(samples, health=health, dark_nodes=dark, peers_steady_s=steady)
        return detect_hang(snap, rc)

    (f,) = hang(SourceHealth.STALE, ("n1",), limit)
    assert f.nodes == ("n1",) and f.cause is Cause.NODE and "n1 went dark" in f.summary
    assert f.evidence["dark_nodes"] == ["n1"] and f.last_healthy_step == 150
    # The dark node is not the metrics' exporter: the view is UP, the blame the same.
    (f,) = hang(SourceHealth.UP, ("n2",), limit)
    assert f.nodes == ("n2",) and f.cause is Cause.NODE
    # Peers that began a step within half the limit are training on: a dead exporter or a
    # cut-off scrape. A STALE view then convicts nothing; an UP one blames no node.
    assert hang(SourceHealth.STALE, ("n1",), limit / 2 - 1) == []
    (f,) = hang(SourceHealth.UP, ("n2",), limit / 2 - 1)
    assert f.nodes == () and f.cause is Cause.UNKNOWN
    # Every node dark (Prometheus's own trouble), no peer step known, a node not in the job.
    assert hang(SourceHealth.STALE, ("n1", "n2", "n3"), limit) == []
    assert hang(SourceHealth.STALE, ("n1",), None) == []
    assert hang(SourceHealth.STALE, ("n9",), limit) == []
    # A node that never began the step outranks one gone dark.
    snap = snapshot(samples, lagging_nodes=("n3",), dark_nodes=("n2",), peers_steady_s=limit)
    assert detect_hang(snap, rc)[0].nodes == ("n3",)


def test_hang_waits_for_a_failing_node_and_blames_no_one_for_exited_processes(
    rc: RecoverySpec,
) -> None:
    """A job's node failing its scrapes, not yet for DARK_AFTER_S, holds the verdict: judged
    at once, a frozen host's hang would name nobody and be restarted, not excluded. A node
    whose processes exited (its host refused the scrape) vouches for the stillness as a dark
    one does, but is not blamed: a rank crashed there, and a restart cures it."""
    samples = simulate(7, steps=400, faults=Faults(hang_at=150), steps_per_sample=1)
    (plain,) = detect_hang(snapshot(samples), rc)
    assert plain.nodes == ()
    limit, onset = plain.evidence["limit_seconds"], plain.fault_time
    unseen = unseen_host_s(samples)
    assert unseen > 0
    # Named by no node: not before a frozen host's first failed scrape could have shown.
    early = upto(samples, onset + limit + unseen / 2)
    assert detect_hang(snapshot(early), rc) == []
    assert detect_hang(snapshot(early, lagging_nodes=("n2",)), rc) != []
    soon = upto(samples, onset + limit + unseen + DARK_AFTER_S / 2)
    assert detect_hang(snapshot(soon), rc) != []
    assert detect_hang(snapshot(soon, failing_nodes=("n2",)), rc) == []
    assert detect_hang(snapshot(soon, failing_nodes=("n9",)), rc) != []  # not the job's
    # A node whose failures never settle (a flapping endpoint) holds it off DARK_AFTER_S only.
    late = upto(samples, onset + limit + unseen + DARK_AFTER_S + 1)
    assert detect_hang(snapshot(late, failing_nodes=("n2",)), rc) != []
    stale = snapshot(samples, health=SourceHealth.STALE, exited_nodes=("n1",), peers_steady_s=limit)
    (f,) = detect_hang(stale, rc)
    assert f.nodes == () and f.cause is Cause.UNKNOWN and "processes on n1 exited" in f.summary
    assert f.evidence["exited_nodes"] == ["n1"] and f.evidence["dark_nodes"] == []
    # A dark host beside it is the one to blame.
    both = dataclasses.replace(
        stale, metrics=dataclasses.replace(stale.metrics, dark_nodes=("n2",))
    )
    assert detect_hang(both, rc)[0].nodes == ("n2",)


def test_hang_needs_a_running_job(rc: RecoverySpec) -> None:
    samples = simulate(7, steps=300, faults=Faults(hang_at=50))
    now = samples[-1].t + 0.5
    assert detect_hang(snapshot(samples, now=now), rc) != []
    assert detect_hang(snapshot(samples, now=now, job_state=AttemptState.SUBMITTED), rc) == []
    assert detect_hang(snapshot(samples, now=now, job_health=SourceHealth.DOWN), rc) == []
    # COMPLETING: SLURM is ending the job (a node it set DOWN is already gone from its node
    # list, so a dark node there would go unnamed); the final state is the finding.
    running = snapshot(samples, now=now, dark_nodes=("n2",), peers_steady_s=1000.0)
    ending = dataclasses.replace(running, job=dataclasses.replace(running.job, completing=True))
    assert detect_hang(ending, rc) == []
    started = dataclasses.replace(ending, metrics=MetricsView(SourceHealth.MISSING))
    assert detect_startup_hang(dataclasses.replace(started, attempt_started_at=0.0), rc) == []


def test_replica_mismatch_and_checkpoint_problems(rc: RecoverySpec) -> None:
    samples = simulate(9, steps=100, faults=Faults(mismatch_from=80))
    (f,) = detect_replica_mismatch(snapshot(samples), rc)
    assert f.first_bad_step == 80 and f.last_healthy_step == 78

    stalled = simulate(9, steps=500, faults=Faults(checkpoints_stop_at=150, checkpoint_failures=2))
    kinds = {f.kind for f in detect_checkpoint_problems(snapshot(stalled), rc)}
    assert kinds == {FindingKind.CHECKPOINT_FAILURE, FindingKind.CHECKPOINT_STALL}
    fine = simulate(9, steps=500)
    assert detect_checkpoint_problems(snapshot(fine), rc) == []
    # Resumed from step 450 on disk: the new process exports 0 until it saves again.
    resumed = [dataclasses.replace(s, checkpoint_step=0) for s in fine]
    assert detect_checkpoint_problems(snapshot(resumed, disk_checkpoint_step=450), rc) == []
    assert detect_checkpoint_problems(snapshot(resumed), rc) != []


@pytest.mark.parametrize("health", [SourceHealth.DOWN, SourceHealth.STALE, SourceHealth.MISSING])
def test_unknown_metrics_never_convict(rc: RecoverySpec, health: SourceHealth) -> None:
    """Even data that shows NaN, spikes and hangs yields nothing unless the source is UP."""
    samples = simulate(
        1, steps=300, faults=Faults(nan_from=200, spike_steps=(150, 300), hang_at=250)
    )
    snap = snapshot(samples, health=health, now=samples[-1].t + 10_000)
    assert detect_all(snap, rc) == []
    up = dataclasses.replace(snap.metrics, health=SourceHealth.UP)
    assert detect_all(dataclasses.replace(snap, metrics=up), rc)


@pytest.mark.parametrize(
    ("state", "kind", "cause"),
    [
        (AttemptState.NODE_FAIL, FindingKind.JOB_NODE_FAIL, Cause.NODE),
        (AttemptState.PREEMPTED, FindingKind.JOB_PREEMPTED, Cause.INFRA),
        (AttemptState.TIMEOUT, FindingKind.JOB_TIMEOUT, Cause.INFRA),
        (AttemptState.OUT_OF_MEMORY, FindingKind.JOB_OOM, Cause.CODE),
        (AttemptState.LOST, FindingKind.JOB_LOST, Cause.UNKNOWN),
        (AttemptState.CANCELLED, FindingKind.JOB_CANCELLED, Cause.UNKNOWN),
    ],
)
def test_job_states(rc: RecoverySpec, state: AttemptState, kind: FindingKind, cause: Cause) -> None:
    (f,) = detect_job_state(snapshot([], job_state=state, failed_nodes=("n2",)), rc)
    assert (f.kind, f.cause) == (kind, cause)
    assert f.nodes == ("n2",)
    assert detect_job_state(snapshot([], job_state=state, job_health=SourceHealth.DOWN), rc) == []


def test_a_gpu_job_without_gpus_is_a_configuration_fault_not_a_crash(rc: RecoverySpec) -> None:
    reason = "no GPU: node n1 sees 0 of the 2 GPUs this job needs"
    snap = snapshot([], job_state=AttemptState.FAILED, exit_code=78, reason=reason)
    (f,) = detect_job_state(snap, rc)
    assert (f.kind, f.cause) == (FindingKind.JOB_NO_GPU, Cause.CODE)
    assert "exit 78" in f.summary and reason in f.summary
    other = detect_job_state(snapshot([], job_state=AttemptState.FAILED, exit_code=1), rc)
    assert [g.kind for g in other] == [FindingKind.JOB_FAILED]


def test_completed_job_before_target_continues_and_at_target_is_quiet(rc: RecoverySpec) -> None:
    completed = AttemptState.COMPLETED
    early = snapshot([], job_state=completed, disk_checkpoint_step=500, target_steps=1000)
    (f,) = detect_job_state(early, rc)
    assert f.kind is FindingKind.JOB_ENDED_EARLY and f.last_healthy_step == 500
    done = snapshot([], job_state=completed, disk_checkpoint_step=1000, target_steps=1000)
    assert detect_job_state(done, rc) == []
    running = snapshot([], job_state=AttemptState.RUNNING)
    assert detect_job_state(running, rc) == []


@pytest.mark.parametrize(
    ("code", "reason", "cause"),
    [
        (75, None, Cause.INFRA),
        (1, "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp", Cause.NODE),
        (1, "torch.cuda: CUDA error: uncorrectable ECC error encountered", Cause.NODE),
        (1, "ModuleNotFoundError: No module named 'megatron'", Cause.CODE),
        (76, "injected crash at step 40", Cause.UNKNOWN),
        (None, None, Cause.UNKNOWN),
    ],
)
def test_classify_failure(code: int | None, reason: str | None, cause: Cause) -> None:
    assert classify_failure(code, reason) is cause


def test_by_step_dedupes_repeated_scrapes_and_restarts(rc: RecoverySpec) -> None:
    samples = simulate(1, steps=20, steps_per_sample=1)
    doubled = [s for s in samples for _ in range(3)]
    assert [s.step for s in by_step(doubled)] == list(range(1, 21))
    restarted = samples[:10] + samples[:5]
    assert [s.step for s in by_step(restarted)] == [1, 2, 3, 4, 5]
    # A resumed process before its first step: gauges at their placeholder zeros.
    placeholder = dataclasses.replace(samples[0], step=10, loss=0.0, last_step_ts=0.0)
    assert [s.step for s in by_step([placeholder, *samples[10:13]])] == [11, 12, 13]
    assert math.isfinite(samples[0].loss or math.nan)


def test_startup_limit_learns_from_the_runs_startups_within_bounds(rc: RecoverySpec) -> None:
    floor = rc.hang_floor_seconds
    assert startup_limit(rc, None) == 10 * floor  # nothing seen yet: conservative
    # A floor sized for fast steps still gives a first start-up a minute.
    small = rc.model_copy(update={"hang_floor_seconds": 1.0})
    assert startup_limit(small, None) == STARTUP_MIN_S
    assert startup_limit(small, 11.0) == 33.0
    assert startup_limit(rc, 1.0) == 2 * floor  # never below two floors
    assert startup_limit(rc, floor) == 3 * floor  # 3 × the slowest startup seen
    assert startup_limit(rc, 100 * floor) == 10 * floor  # never above the default


def test_startup_hang_after_ten_floors_without_a_first_step(rc: RecoverySpec) -> None:
    started = 1_000_000.0
    limit = 10 * rc.hang_floor_seconds
    waiting = snapshot([], health=SourceHealth.MISSING, now=started + limit - 1)
    waiting = dataclasses.replace(waiting, attempt_started_at=started)
    assert detect_startup_hang(waiting, rc) == []
    stuck = dataclasses.replace(waiting, now=started + limit + 1)
    (f,) = detect_startup_hang(stuck, rc)
    assert f.kind is FindingKind.HANG and f.fault_time == started and f.nodes == ()
    # Progress seen, a failed metrics source, or no running job: not a startup hang.
    trained = simulate(1, steps=10)
    progressed = dataclasses.replace(stuck, metrics=snapshot(trained).metrics)
    assert detect_startup_hang(progressed, rc) == []
    blind = snapshot([], health=SourceHealth.DOWN, now=started + limit + 1)
    assert detect_startup_hang(dataclasses.replace(blind, attempt_started_at=started), rc) == []
    pending = snapshot([], health=SourceHealth.MISSING, job_state=AttemptState.SUBMITTED)
    assert detect_startup_hang(dataclasses.replace(pending, attempt_started_at=0.0), rc) == []


@pytest.mark.parametrize("steps_per_sample", [1, 3])
def test_short_spike_far_above_the_trailing_max_is_found_without_sustain(
    rc: RecoverySpec, steps_per_sample: int
) -> None:
    """W5: a 2-step spike of 30× is over before the sustain window fills; Megatron's rule
    (loss > 10 × the trailing max) flags it, with the onset bounded as for a sustained one."""
    for seed in range(10):
        samples = simulate(
            seed,
            steps=300,
            steps_per_sample=steps_per_sample,
            faults=Faults(spike_steps=(200, 202), spike_factor=30.0),
        )
        upto = [s for s in samples if (s.step or 0) <= 206]
        (f,) = detect_loss_spike(snapshot(upto), rc)
        assert f.evidence["rule"] == "hard_factor", seed
        assert f.last_healthy_step is not None and f.first_bad_step is not None
        assert f.last_healthy_step < 200 <= f.first_bad_step
        lo, hi = f.sample_window  # type: ignore[misc]
        assert lo <= 199 * GLOBAL_BATCH < hi
        off = rc.model_copy(update={"loss_spike_hard_factor": 40.0})
        assert detect_loss_spike(snapshot(upto), off) == []
        # Seen in one scrape only and long gone by the tick: still found (the soak's miss).
        later = [s for s in samples if (s.step or 0) <= 260]
        (late,) = detect_loss_spike(snapshot(later), rc)
        assert late.evidence["rule"] == "hard_factor" and late.first_bad_step is not None
        assert late.last_healthy_step < 200 <= late.first_bad_step


def _split_at_restart(
    samples: list[MetricSample], resume: int, restart: int
) -> tuple[list[MetricSample], list[MetricSample]]:
    """(the previous attempt's samples up to step `restart`, the new attempt's from `resume`)."""
    prior = [s for s in samples if (s.step or 0) <= restart]
    return prior, [s for s in samples if (s.step or 0) > resume]


def test_spike_right_after_a_restart_is_judged_against_the_previous_attempt(
    rc: RecoverySpec,
) -> None:
    """The short soak's miss: a poisoned window a few steps into a fresh attempt. The
    attempt's own scrapes are too few for a baseline, so the previous attempt's samples below
    the resume point serve as one; the onset is still bounded by a healthy sample."""
    for seed in range(10):
        samples = simulate(seed, steps=300, faults=Faults(spike_steps=(110, 160)))
        prior, own = _split_at_restart(samples, resume=100, restart=104)
        own = [s for s in own if (s.step or 0) <= 116]
        assert detect_loss_spike(snapshot(own), rc) == [], seed
        (f,) = detect_loss_spike(snapshot(own, prior=prior), rc)
        assert f.last_healthy_step is not None and f.first_bad_step is not None
        assert f.last_healthy_step < 110 <= f.first_bad_step, seed
        # Bad from the attempt's first sample: the onset is bounded by the attempt's start,
        # not by the previous attempt's last healthy step (the restart is not downtime).
        at_once = simulate(seed, steps=300, faults=Faults(spike_steps=(101, 160)))
        prior, own = _split_at_restart(at_once, resume=100, restart=104)
        own = [s for s in own if (s.step or 0) <= 110]
        started = own[0].t - 0.2
        snap = dataclasses.replace(snapshot(own, prior=prior), attempt_started_at=started)
        (g,) = detect_loss_spike(snap, rc)
        assert g.last_healthy_step is not None and g.last_healthy_step <= 100
        assert g.fault_time == started, seed


def test_spike_after_a_restart_is_judged_when_scrapes_are_sparse(rc: RecoverySpec) -> None:
    """The short soak on a fast machine: 16 steps a scrape, so the loss window's 50 steps
    before the resume point hold 3 of the previous attempt's samples, too few with the
    attempt's own for any baseline while the attempt has made two scrapes. The prior then
    lends its last BASELINE_MIN_POINTS samples, as a sparse window does within an attempt."""
    for seed in range(10):
        samples = simulate(
            seed,
            steps=300,
            steps_per_sample=16,
            faults=Faults(spike_steps=(120, 124), spike_factor=30.0),
        )
        prior, own = _split_at_restart(samples, resume=100, restart=140)
        own = [s for s in own if (s.step or 0) <= 140]
        (f,) = detect_loss_spike(snapshot(own, prior=prior), rc)
        assert f.last_healthy_step is not None and f.first_bad_step is not None
        assert f.last_healthy_step < 120 <= f.first_bad_step, seed


def test_previous_attempt_only_lends_a_baseline(rc: RecoverySpec) -> None:
    """Healthy fresh attempts stay quiet with the prior attached, and a spike that lies only
    in the prior (the fault the restart was for) convicts nothing in the new attempt."""
    for seed in range(30):
        samples = simulate(seed, steps=300, steps_per_sample=3)
        prior, own = _split_at_restart(samples, resume=150, restart=158)
        for end in range(1, len(own), 4):
            assert detect_all(snapshot(own[:end], prior=prior), rc) == [], (seed, end)
    spiked = simulate(4, steps=300, faults=Faults(spike_steps=(140, 150), spike_factor=30.0))
    prior, own = _split_at_restart(spiked, resume=100, restart=150)
    healthy = simulate(4, steps=300)
    own = [s for s in healthy if 150 < (s.step or 0) <= 170]
    assert detect_loss_spike(snapshot(own, prior=prior), rc) == []


def test_fresh_attempt_exporting_checkpoint_zero_is_not_a_stall(rc: RecoverySpec) -> None:
    """W3: a resumed process exports checkpoint step 0 until it saves; the checkpoints on
    disk are recent, so a fresh attempt shaped like the soak's (resumed from 90, interval
    10, gauge 0) yields no finding at all."""
    samples = simulate(2, steps=104, steps_per_sample=1, faults=Faults(checkpoint_every=10_000))
    fresh = [s for s in samples if (s.step or 0) > 90]
    assert all(s.checkpoint_step == 0 for s in fresh)
    snap = dataclasses.replace(
        snapshot(fresh, disk_checkpoint_step=100, attempt=2), checkpoint_interval_steps=10
    )
    assert detect_all(snap, rc) == []
    stale = dataclasses.replace(snap, disk_checkpoint_step=60)
    assert [f.kind for f in detect_all(stale, rc)] == [FindingKind.CHECKPOINT_STALL]


def test_nonfinite_grads_with_a_finite_loss_are_marked_grads_only(rc: RecoverySpec) -> None:
    """W4: the evidence the policy needs to tell a node's NaN grads from NaN-making data."""
    samples = simulate(1, steps=200, steps_per_sample=2)
    sick = [
        dataclasses.replace(s, grad_norm=math.nan, nonfinite_total=float(s.step - 150))  # type: ignore[operator]
        if (s.step or 0) > 150
        else s
        for s in samples
    ]
    (f,) = detect_nonfinite(snapshot(sick), rc)
    assert f.evidence["grads_only"] is True
    data = simulate(1, steps=200, steps_per_sample=2, faults=Faults(nan_from=151))
    assert detect_nonfinite(snapshot(data), rc)[0].evidence["grads_only"] is False


#: The short chaos soak's seed-3 run (poison_data: samples [864, 896) trained at steps
#: 109-112, loss ~180 against ~6.5) as its watchdog saw it on the tick at +50.06 s: the
#: previous attempts' samples below the resume point (one bridged scrape of each), then
#: attempt 3's bridged scrape and Prometheus's scrapes (from the run's TSDB). Columns:
#: seconds, step, loss, loss window max, loss window min, samples consumed, last-step time.
_SOAK_SEED3_PRIOR = [
    (33.92, 19, 7.701, 8.307, 7.685, 152, 33.866),
    (39.96, 50, 6.876, 7.179, 6.524, 400, 39.827),
]
_SOAK_SEED3_OWN = [
    (46.03, 69, 6.514, 6.960, 5.931, 552, 45.990),
    (47.51, 94, 6.483, 6.693, 5.626, 752, 47.512),
    (48.51, 110, 181.757, 182.385, 5.800, 880, 48.391),
    (49.51, 129, 6.297, 6.586, 5.653, 1032, 49.480),
]


def _soak_samples(
    rows: list[tuple[float, int, float, float, float, int, float]],
) -> list[MetricSample]:
    base = 1_000_000.0
    return [
        MetricSample(
            t=base + t,
            step=step,
            loss=loss,
            loss_window_max=wmax,
            loss_window_min=wmin,
            samples_consumed=consumed,
            last_step_ts=base + last,
        )
        for t, step, loss, wmax, wmin, consumed, last in rows
    ]


def test_soak_spike_seen_in_one_scrape_after_two_restarts_is_found(rc: RecoverySpec) -> None:
    """A soak's miss, replayed from its TSDB and rank logs: after a crash and a NaN rollback
    the poisoned window showed in one scrape only, the 5th of the 6 samples held (2 prior +
    4 own). A gate counted in scrapes judged no sample before the 6th, so that one was never judged;
    counted in steps watched, the 3 samples before it have watched ~60 steps and it is
    judged (10 × a trailing max of 7.7 is 77 < 182)."""
    prior = _soak_samples(_SOAK_SEED3_PRIOR)
    own = _soak_samples(_SOAK_SEED3_OWN)
    snap = snapshot(own, now=own[-1].t + 0.55, prior=prior, nodes=("n2", "n3"))
    (f,) = detect_all(snap, rc)
    assert f.kind is FindingKind.LOSS_SPIKE and f.evidence["rule"] == "hard_factor"
    assert (f.last_healthy_step, f.first_bad_step) == (94, 110)
    assert f.sample_window == (752, 880)  # holds the poisoned window's start, 864
    # The run's last scrape (step 146, on the next tick) does not hide it either.
    (last,) = _soak_samples([(50.51, 146, 5.448, 6.525, 5.448, 1168, 50.496)])
    (g,) = detect_loss_spike(snapshot([*own, last], prior=prior, nodes=("n2", "n3")), rc)
    assert (g.last_healthy_step, g.first_bad_step) == (94, 110)
    # The same scrapes with step 110 healthy (the loss and window max of steps 108, 107)
    # yield nothing.
    clean = [*own[:2], dataclasses.replace(own[2], loss=6.382, loss_window_max=6.739), own[3]]
    assert detect_all(snapshot(clean, prior=prior, nodes=("n2", "n3")), rc) == []


@pytest.mark.parametrize("steps_per_sample", [20, 33, 40])
def test_spike_between_scrapes_further_apart_than_the_window_is_found(
    rc: RecoverySpec, steps_per_sample: int
) -> None:
    """Scrapes further apart than the trainer's loss window (the soak's 2 s ticks at ~20 steps
    a second): a 4-step 25× spike no window ever showed is still in the loss counters, and is
    found with its onset bounded by the scrapes around it; a clean run at the same spacing
    stays quiet."""
    for seed in range(10):
        samples = simulate(
            seed,
            steps=400,
            steps_per_sample=steps_per_sample,
            faults=Faults(spike_steps=(201, 205), spike_factor=25.0),
        )
        after = next(s for s in samples if (s.step or 0) >= 205)
        assert after.loss_window_max < 2 * after.loss, "the window shows it: not this case"
        (f,) = detect_loss_spike(snapshot([s for s in samples if s.step <= after.step]), rc)
        assert f.evidence["rule"] == "hard_factor_sum", seed
        assert f.last_healthy_step < 201 <= f.first_bad_step == after.step
        lo, hi = f.sample_window  # type: ignore[misc]
        assert lo <= 200 * GLOBAL_BATCH < 204 * GLOBAL_BATCH < hi
        clean = simulate(seed, steps=400, steps_per_sample=steps_per_sample)
        assert detect_loss_spike(snapshot(clean), rc) == [], seed


def test_straggler_due_a_scrape_later_while_a_node_shows_slow(rc: RecoverySpec) -> None:
    """A straggler verdict needs k samples in a row: while the newest shows a slow node, the
    loop looks again when the next sample can be read; a healthy sample asks for nothing."""
    samples = simulate(3, steps=40, steps_per_sample=2)
    healthy = snapshot(samples)
    assert straggler_due(healthy, rc) is None
    slow = [*samples[:-1], dataclasses.replace(samples[-1], step_time={"n1": 1.0, "n2": 3.0})]
    snap = snapshot(slow)
    assert straggler_due(snap, rc) == next_read(slow, snap.now)
    # k slow samples in a row make the verdict (or the policy declined it): no more looks.
    k = rc.loss_spike_sustain_steps
    judged = [
        *samples[:-k],
        *(dataclasses.replace(x, step_time={"n1": 1.0, "n2": 3.0}) for x in samples[-k:]),
    ]
    assert straggler_due(snapshot(judged), rc) is None
    assert verdict_due(snap, rc) == straggler_due(snap, rc)  # sooner than hang_due
    assert verdict_due(healthy, rc) == hang_due(healthy, rc)
    # The next read: the first sample after `after`, as the scrapes go on at their interval.
    periodic = _periodic(1000, until=1010.0)
    assert next_read(periodic, 1010.1) == 1010.25 + SAMPLE_SETTLE * 0.25
    assert next_read(periodic, 1009.0) == 1010.25 + SAMPLE_SETTLE * 0.25  # no sample earlier
    assert next_read(periodic[:1], 1010.0) is None  # no interval yet
