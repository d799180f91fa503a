"""Policy: one remedy per situation, cause-aware escalation, budgets, unknown ≠ healthy."""

from __future__ import annotations

import dataclasses

import pytest
from watchdog_curves import GLOBAL_BATCH, snapshot

from contracts.spec import RecoverySpec
from supervisor.metrics_in import MetricSample, SourceHealth
from supervisor.models import AttemptState
from supervisor.slurm import JobState
from supervisor.watchdog.detectors import detect_all
from supervisor.watchdog.policy import (
    budget_left,
    decide,
    first_submit,
    resume_point,
    rollback_target,
)
from supervisor.watchdog.snapshot import (
    Cause,
    CheckpointRef,
    Finding,
    FindingKind,
    PastRemedy,
    Remedy,
    RemedyKind,
    RunHistory,
)

NOW = 1_000_000.0
NODES = ("n1", "n2")
CKPTS = tuple(CheckpointRef(step=s, saved_at=NOW - 1000 + s) for s in (100, 200, 300))


def nan_at(healthy: int, bad: int) -> Finding:
    return Finding(
        kind=FindingKind.NONFINITE,
        summary="nan",
        cause=Cause.DATA,
        last_healthy_step=healthy,
        first_bad_step=bad,
        sample_window=(healthy * GLOBAL_BATCH, bad * GLOBAL_BATCH),
    )


def snap_at(step: int, **kw: object):  # type: ignore[no-untyped-def]
    sample = MetricSample(t=NOW - 1, step=step)
    return snapshot([sample], now=NOW, nodes=NODES, **kw)  # type: ignore[arg-type]


def past(kind: RemedyKind, finding: FindingKind, *, ago: float = 60, **kw: object) -> PastRemedy:
    return PastRemedy(kind=kind, attempt=1, at=NOW - ago, finding_kind=finding, **kw)  # type: ignore[arg-type]


def test_no_findings_is_none(rc: RecoverySpec) -> None:
    r = decide(snap_at(10), [], RunHistory(), rc)
    assert r.kind is RemedyKind.NONE and r.reason == "healthy"
    down = snap_at(10, health=SourceHealth.DOWN)
    assert decide(down, [], RunHistory(), rc).reason == "unknown"


def test_first_numeric_fault_rolls_back_before_onset_and_skips(rc: RecoverySpec) -> None:
    r = decide(snap_at(255), [nan_at(250, 254)], RunHistory(checkpoints=CKPTS), rc)
    assert r.kind is RemedyKind.ROLLBACK and r.suspect is Cause.DATA
    assert r.to_step == 200
    assert r.skip_ranges == ((250 * GLOBAL_BATCH, 254 * GLOBAL_BATCH),)


def test_rollback_extra_skip_and_from_scratch(rc: RecoverySpec) -> None:
    extra = rc.model_copy(update={"rollback_skip_steps": 10})
    r = decide(snap_at(55), [nan_at(50, 54)], RunHistory(), extra)
    assert r.to_step == 0
    assert r.skip_ranges == ((50 * GLOBAL_BATCH, (54 + 10) * GLOBAL_BATCH),)
    # A checkpoint saved exactly at the last healthy step is fine; one after it is not.
    assert rollback_target(nan_at(300, 304), RunHistory(checkpoints=CKPTS)) == 300
    assert rollback_target(nan_at(299, 304), RunHistory(checkpoints=CKPTS)) == 200


def test_bad_data_running_past_the_skip_extends_it_then_suspects_node(rc: RecoverySpec) -> None:
    first = past(
        RemedyKind.ROLLBACK,
        FindingKind.NONFINITE,
        step=254,
        skip_ranges=((2000, 2032),),
        attempt_nodes=NODES,
    )
    # The new bad window starts where the skip ended: skip more.
    cont = Finding(
        kind=FindingKind.NONFINITE,
        summary="nan",
        last_healthy_step=250,
        first_bad_step=252,
        sample_window=(2032, 2048),
    )
    hist = RunHistory(remedies=(first,), checkpoints=CKPTS, attempt_nodes=NODES)
    r = decide(snap_at(253), [cont], hist, rc)
    # The bad data outran a 32-sample skip: skip at least twice that from where it resumes.
    assert r.kind is RemedyKind.ROLLBACK and r.skip_ranges == ((2032, 2032 + 64),)
    # Seen first right after the resume, the window starts at a healthy sample from before
    # the skip and spans it: the same bad data running on, not other data.
    spanning = dataclasses.replace(cont, sample_window=(2016, 2048))
    r_span = decide(snap_at(253), [spanning], hist, rc)
    assert r_span.kind is RemedyKind.ROLLBACK and r_span.skip_ranges == ((2016, 2016 + 64),)
    before = dataclasses.replace(cont, sample_window=(1900, 1990))
    assert decide(snap_at(253), [before], hist, rc).kind is RemedyKind.EXCLUDE_NODE
    # Budget of rollbacks per incident (2) spent: suspect a node of every faulty attempt.
    second = past(
        RemedyKind.ROLLBACK,
        FindingKind.NONFINITE,
        step=253,
        skip_ranges=((2032, 2048),),
        attempt_nodes=NODES,
    )
    hist2 = RunHistory(
        remedies=(first, second),
        checkpoints=CKPTS,
        attempt_nodes=NODES,
        node_strikes={"n2": 3},
    )
    cont2 = Finding(
        kind=FindingKind.NONFINITE,
        summary="nan",
        last_healthy_step=250,
        first_bad_step=252,
        sample_window=(2048, 2064),
    )
    r2 = decide(snap_at(254), [cont2], hist2, rc)
    assert r2.kind is RemedyKind.EXCLUDE_NODE and r2.exclude_nodes == ("n2",)
    assert r2.suspect is Cause.NODE


def test_recurrence_at_other_data_suspects_the_node(rc: RecoverySpec) -> None:
    first = past(
        RemedyKind.ROLLBACK,
        FindingKind.LOSS_SPIKE,
        step=254,
        skip_ranges=((2000, 2032),),
        attempt_nodes=("n1", "n3"),
    )
    hist = RunHistory(remedies=(first,), checkpoints=CKPTS, attempt_nodes=("n1", "n2"))
    r = decide(snap_at(280), [nan_at(270, 272)], hist, rc)
    # Only n1 was in both faulty attempts.
    assert r.kind is RemedyKind.EXCLUDE_NODE and r.exclude_nodes == ("n1",)


def test_fault_that_follows_the_job_to_new_nodes_is_data_or_code(rc: RecoverySpec) -> None:
    excl = past(
        RemedyKind.EXCLUDE_NODE,
        FindingKind.NONFINITE,
        step=260,
        excluded=("n1",),
        attempt_nodes=("n1",),
    )
    hist = RunHistory(
        remedies=(excl,),
        excluded_nodes=frozenset({"n1"}),
        checkpoints=CKPTS,
        attempt_nodes=("n4",),
    )
    r = decide(snap_at(270), [nan_at(265, 268)], hist, rc)
    assert r.kind is RemedyKind.ROLLBACK and r.suspect is Cause.DATA
    tried = RunHistory(
        remedies=(
            past(
                RemedyKind.ROLLBACK,
                FindingKind.NONFINITE,
                ago=120,
                step=250,
                attempt_nodes=("n1",),
                skip_ranges=((0, 8),),
            ),
            excl,
        ),
        excluded_nodes=frozenset({"n1"}),
        checkpoints=CKPTS,
        attempt_nodes=("n4",),
    )
    r2 = decide(snap_at(270), [nan_at(265, 268)], tried, rc)
    assert r2.kind is RemedyKind.ESCALATE and r2.suspect is Cause.CODE


def test_restart_storm_escalates_but_requeues_do_not_count(rc: RecoverySpec) -> None:
    hang = Finding(kind=FindingKind.HANG, summary="hang", last_healthy_step=100)
    restarts = tuple(
        past(RemedyKind.RESTART, FindingKind.JOB_FAILED, ago=60 * i, step=100 + i)
        for i in range(1, 6)
    )
    r = decide(snap_at(106), [hang], RunHistory(remedies=restarts), rc)
    assert r.kind is RemedyKind.ESCALATE and "restart storm" in r.reason
    old = tuple(
        past(RemedyKind.RESTART, FindingKind.JOB_FAILED, ago=3600 + i, step=100 + i)
        for i in range(5)
    )
    assert decide(snap_at(500), [hang], RunHistory(remedies=old), rc).kind is RemedyKind.RESTART
    requeues = tuple(
        past(RemedyKind.REQUEUE, FindingKind.JOB_PREEMPTED, ago=10 * i) for i in range(10)
    )
    assert decide(snap_at(500), [hang], RunHistory(remedies=requeues), rc).kind is (
        RemedyKind.RESTART
    )


def test_restarts_that_held_are_no_storm(rc: RecoverySpec) -> None:
    """Five remedies in 30 min, each the cure of a different fault hundreds of steps apart,
    are no reason to escalate at the next crash. Only restarts the run failed again soon after
    (within `restart_held_steps`) are a storm; one that did not hold still counts."""
    crash = Finding(kind=FindingKind.JOB_FAILED, summary="crash")
    gap = rc.restart_held_steps
    cured = tuple(
        past(RemedyKind.RESTART, FindingKind.HANG, ago=300 - 50 * i, step=1000 + gap * i)
        for i in range(rc.max_restarts)
    )
    now_step = 1000 + gap * rc.max_restarts
    assert decide(snap_at(now_step), [crash], RunHistory(remedies=cured), rc).kind is (
        RemedyKind.RESTART
    )
    last_failed_fast = decide(snap_at(now_step - gap + 1), [crash], RunHistory(remedies=cured), rc)
    assert last_failed_fast.kind is RemedyKind.RESTART  # 1 of 5 did not hold
    tight = tuple(
        past(RemedyKind.RESTART, FindingKind.HANG, ago=300 - 50 * i, step=1000 + (gap - 1) * i)
        for i in range(rc.max_restarts)
    )
    r = decide(snap_at(1000 + (gap - 1) * rc.max_restarts), [crash], RunHistory(remedies=tight), rc)
    assert r.kind is RemedyKind.ESCALATE and "restart storm" in r.reason


def test_no_progress_cycle_escalates(rc: RecoverySpec) -> None:
    crash = Finding(kind=FindingKind.JOB_FAILED, summary="crash")
    cycle = tuple(
        past(RemedyKind.RESTART, FindingKind.HANG, ago=3000 - i, step=120) for i in range(3)
    )
    loose = rc.model_copy(update={"max_restarts": 50})
    r = decide(snap_at(118), [crash], RunHistory(remedies=cycle), loose)
    assert r.kind is RemedyKind.ESCALATE and "no progress" in r.reason


def test_hang_restarts_then_excludes_common_node(rc: RecoverySpec) -> None:
    hang = Finding(kind=FindingKind.HANG, summary="hang", last_healthy_step=100)
    hist = RunHistory(attempt_nodes=NODES)
    assert decide(snap_at(100), [hang], hist, rc).kind is RemedyKind.RESTART
    again = RunHistory(
        remedies=(
            past(RemedyKind.RESTART, FindingKind.HANG, step=100, attempt_nodes=("n2", "n3")),
        ),
        attempt_nodes=NODES,
    )
    r = decide(snap_at(100), [hang], again, rc)
    assert r.kind is RemedyKind.EXCLUDE_NODE and r.exclude_nodes == ("n2",)


def test_hang_recurring_on_other_nodes_restarts_again(rc: RecoverySpec) -> None:
    """No node was in both hung attempts: nobody to blame, and not a reason to page."""
    hang = Finding(kind=FindingKind.HANG, summary="hang", last_healthy_step=100)
    hist = RunHistory(
        remedies=(
            past(RemedyKind.RESTART, FindingKind.HANG, step=100, attempt_nodes=("n3", "n4")),
        ),
        attempt_nodes=NODES,
    )
    r = decide(snap_at(100), [hang], hist, rc)
    assert r.kind is RemedyKind.RESTART and "other nodes" in r.reason


def test_hang_named_on_a_node_excludes_it_at_once(rc: RecoverySpec) -> None:
    """The node that never began the step its peers wait in: its hang, like a NaN its own
    gradients made, is excluded at once, and the run resumes from its newest checkpoint."""
    hang = Finding(
        kind=FindingKind.HANG,
        summary="hang; n2 never began it",
        cause=Cause.NODE,
        last_healthy_step=100,
        nodes=("n2",),
    )
    r = decide(snap_at(100), [hang], RunHistory(attempt_nodes=NODES), rc)
    assert r.kind is RemedyKind.EXCLUDE_NODE and r.exclude_nodes == ("n2",) and r.to_step is None


def test_a_named_crash_after_an_unnamed_one_restarts(rc: RecoverySpec) -> None:
    """An earlier failure that named no node blames none of its attempt's nodes for a crash."""
    crash = Finding(kind=FindingKind.JOB_FAILED, summary="rank died", nodes=("n2",))
    for kind in (FindingKind.JOB_FAILED, FindingKind.JOB_LOST):
        unnamed = past(RemedyKind.RESTART, kind, step=100, attempt_nodes=NODES)
        r = decide(snap_at(100), [crash], RunHistory(remedies=(unnamed,), attempt_nodes=NODES), rc)
        assert r.kind is RemedyKind.RESTART, (kind, r)


def test_exclusion_budget_escalates(rc: RecoverySpec) -> None:
    fail = Finding(
        kind=FindingKind.JOB_NODE_FAIL, summary="node fail", cause=Cause.NODE, nodes=("n2",)
    )
    ok = decide(snap_at(10, job_state=AttemptState.NODE_FAIL), [fail], RunHistory(), rc)
    assert ok.kind is RemedyKind.EXCLUDE_NODE and ok.exclude_nodes == ("n2",)
    full = RunHistory(excluded_nodes=frozenset({"n7", "n8"}))
    r = decide(snap_at(10), [fail], full, rc)
    assert r.kind is RemedyKind.ESCALATE and "budget" in r.reason
    unknown_node = Finding(kind=FindingKind.JOB_NODE_FAIL, summary="node fail", cause=Cause.NODE)
    assert decide(snap_at(10), [unknown_node], RunHistory(), rc).kind is RemedyKind.RESTART


def test_a_job_ended_by_a_node_the_run_had_left_is_resubmitted(rc: RecoverySpec) -> None:
    """The run moved off n2 to a spare inside the job, and SLURM still ended the job on n2's
    failure: nothing is left to exclude, and nothing to escalate either."""
    fail = Finding(
        kind=FindingKind.JOB_NODE_FAIL, summary="job 2 node_fail", cause=Cause.NODE, nodes=("n2",)
    )
    left = RunHistory(excluded_nodes=frozenset({"n2"}))
    r = decide(snap_at(10, job_state=AttemptState.NODE_FAIL), [fail], left, rc)
    assert r.kind is RemedyKind.RESTART and "n2 excluded already" in r.reason
    both = dataclasses.replace(fail, nodes=("n2", "n3"))
    r = decide(snap_at(10, job_state=AttemptState.NODE_FAIL), [both], left, rc)
    assert r.kind is RemedyKind.EXCLUDE_NODE and r.exclude_nodes == ("n3",)


@pytest.mark.parametrize(
    ("kind", "cause", "expected"),
    [
        (FindingKind.JOB_PREEMPTED, Cause.INFRA, RemedyKind.REQUEUE),
        (FindingKind.JOB_TIMEOUT, Cause.INFRA, RemedyKind.REQUEUE),
        (FindingKind.JOB_ENDED_EARLY, Cause.INFRA, RemedyKind.REQUEUE),
        (FindingKind.JOB_FAILED, Cause.INFRA, RemedyKind.REQUEUE),
        (FindingKind.JOB_FAILED, Cause.CODE, RemedyKind.ESCALATE),
        (FindingKind.JOB_FAILED, Cause.UNKNOWN, RemedyKind.RESTART),
        (FindingKind.JOB_OOM, Cause.CODE, RemedyKind.ESCALATE),
        (FindingKind.JOB_NO_GPU, Cause.CODE, RemedyKind.ESCALATE),
        (FindingKind.JOB_CANCELLED, Cause.UNKNOWN, RemedyKind.ESCALATE),
        (FindingKind.JOB_LOST, Cause.UNKNOWN, RemedyKind.RESTART),
        (FindingKind.REPLICA_MISMATCH, Cause.UNKNOWN, RemedyKind.ESCALATE),
        (FindingKind.EVAL_JUMP, Cause.UNKNOWN, RemedyKind.ESCALATE),
        (FindingKind.CHECKPOINT_STALL, Cause.INFRA, RemedyKind.ESCALATE),
        (FindingKind.CHECKPOINT_FAILURE, Cause.INFRA, RemedyKind.OBSERVE),
        (FindingKind.THROUGHPUT_DROP, Cause.UNKNOWN, RemedyKind.OBSERVE),
    ],
)
def test_remedy_by_kind(
    rc: RecoverySpec, kind: FindingKind, cause: Cause, expected: RemedyKind
) -> None:
    f = Finding(kind=kind, summary=kind.value, cause=cause)
    assert decide(snap_at(10), [f], RunHistory(), rc).kind is expected


def test_crash_on_named_node_excludes_it(rc: RecoverySpec) -> None:
    f = Finding(kind=FindingKind.JOB_FAILED, summary="NCCL", cause=Cause.NODE, nodes=("n1",))
    r = decide(snap_at(10), [f], RunHistory(), rc)
    assert r.kind is RemedyKind.EXCLUDE_NODE and r.exclude_nodes == ("n1",)


@pytest.mark.parametrize(
    "kind", [FindingKind.NONFINITE, FindingKind.JOB_NODE_FAIL, FindingKind.HANG]
)
def test_slurm_unknown_never_destructive(rc: RecoverySpec, kind: FindingKind) -> None:
    f = Finding(kind=kind, summary=kind.value, last_healthy_step=5, first_bad_step=6)
    r = decide(snap_at(10, job_health=SourceHealth.DOWN), [f], RunHistory(), rc)
    assert r.kind is RemedyKind.OBSERVE and not r.kind.resubmits


def test_trusted_checkpoints_drop_state_thrown_away_by_a_rollback() -> None:
    from supervisor.watchdog.policy import trusted_checkpoints

    ckpts = [CheckpointRef(step=s, saved_at=t) for s, t in ((100, 10.0), (120, 20.0), (140, 50.0))]
    # Rolled back to 100; the attempt resuming from it started at t = 30.
    assert [c.step for c in trusted_checkpoints(ckpts, [(100, 30.0)])] == [100, 140]
    # Not started yet: nothing past 100 is trusted.
    assert [c.step for c in trusted_checkpoints(ckpts, [(100, None)])] == [100]
    assert trusted_checkpoints(ckpts, []) == ckpts


def test_exclusion_needs_a_spare_node(rc: RecoverySpec) -> None:
    fail = Finding(
        kind=FindingKind.JOB_NODE_FAIL, summary="node fail", cause=Cause.NODE, nodes=("n2",)
    )
    spare = RunHistory(usable_nodes=frozenset({"n1", "n2", "n3"}), nodes_needed=2)
    assert decide(snap_at(10), [fail], spare, rc).kind is RemedyKind.EXCLUDE_NODE
    tight = RunHistory(usable_nodes=frozenset({"n1", "n2"}), nodes_needed=2)
    r = decide(snap_at(10), [fail], tight, rc)
    assert r.kind is RemedyKind.ESCALATE and "no spare node" in r.reason


def crash_on(node: str) -> Finding:
    return Finding(kind=FindingKind.JOB_FAILED, summary="rank killed", nodes=(node,))


def test_plain_crash_restarts_and_excludes_only_when_it_recurs_on_the_same_node(
    rc: RecoverySpec,
) -> None:
    """W1: a killed rank is a restart; its node is suspected only if it crashes there again."""
    history = RunHistory(attempt_nodes=NODES)
    assert decide(snap_at(10), [crash_on("n2")], history, rc).kind is RemedyKind.RESTART
    before = past(
        RemedyKind.RESTART, FindingKind.JOB_FAILED, finding_nodes=("n2",), attempt_nodes=NODES
    )
    history = RunHistory(remedies=(before,), attempt_nodes=NODES)
    elsewhere = decide(snap_at(20), [crash_on("n1")], history, rc)
    assert elsewhere.kind is RemedyKind.RESTART
    again = decide(snap_at(20), [crash_on("n2")], history, rc)
    assert again.kind is RemedyKind.EXCLUDE_NODE and again.exclude_nodes == ("n2",)


def test_crashes_far_apart_on_one_node_of_two_are_chance_not_the_node(rc: RecoverySpec) -> None:
    """A crash 5,000 steps after an unrelated one, on the same node of a 2-node job (a coin
    flip), must not exclude that node. Only a crash loop (the restart did not hold) or a
    job wide enough that chance rarely repeats a node blames it."""
    held = rc.restart_held_steps

    def history(step: int, nodes: tuple[str, ...]) -> RunHistory:
        before = past(
            RemedyKind.RESTART,
            FindingKind.JOB_FAILED,
            step=step,
            finding_nodes=("n2",),
            attempt_nodes=nodes,
        )
        return RunHistory(remedies=(before,), attempt_nodes=nodes)

    far = decide(snap_at(1000 + held), [crash_on("n2")], history(1000, NODES), rc)
    assert far.kind is RemedyKind.RESTART and "no crash loop" in far.reason
    loop = decide(snap_at(1000 + held - 1), [crash_on("n2")], history(1000, NODES), rc)
    assert loop.kind is RemedyKind.EXCLUDE_NODE and loop.exclude_nodes == ("n2",)
    wide = tuple(f"n{i}" for i in range(1, 21))
    r = decide(snap_at(1000 + held), [crash_on("n2")], history(1000, wide), rc)
    assert r.kind is RemedyKind.EXCLUDE_NODE and r.exclude_nodes == ("n2",)


def test_unnamed_crashes_far_apart_do_not_indict_the_nodes_they_shared(rc: RecoverySpec) -> None:
    """The same for crashes whose evidence names no node (a SIGKILLed rank): the nodes both
    attempts ran on are suspected only after a crash loop or in a wide job (the full soak of
    seed 47 excluded a healthy node of two this way, 2,400 steps after the first crash)."""
    held = rc.restart_held_steps
    unnamed = Finding(kind=FindingKind.JOB_FAILED, summary="job 2 failed: connection closed")

    def history(step: int, nodes: tuple[str, ...]) -> RunHistory:
        before = past(RemedyKind.RESTART, FindingKind.JOB_FAILED, step=step, attempt_nodes=nodes)
        return RunHistory(remedies=(before,), attempt_nodes=nodes)

    far = decide(snap_at(1000 + held), [unnamed], history(1000, NODES), rc)
    assert far.kind is RemedyKind.RESTART and "no crash loop" in far.reason
    loop = decide(snap_at(1000 + held - 1), [unnamed], history(1000, NODES), rc)
    assert loop.kind is RemedyKind.EXCLUDE_NODE and loop.exclude_nodes == (NODES[0],)
    wide = tuple(f"n{i}" for i in range(1, 21))
    r = decide(snap_at(1000 + held), [unnamed], history(1000, wide), rc)
    assert r.kind is RemedyKind.EXCLUDE_NODE


def test_never_excludes_a_name_that_is_not_one_of_the_attempts_nodes(rc: RecoverySpec) -> None:
    """W1: sbatch rejects `--exclude=127.0.0.1`, so every resubmission would fail."""
    f = Finding(kind=FindingKind.JOB_FAILED, summary="gloo", cause=Cause.NODE, nodes=("127.0.0.1",))
    r = decide(snap_at(10), [f], RunHistory(attempt_nodes=NODES), rc)
    assert "127.0.0.1" not in r.exclude_nodes and r.kind is not RemedyKind.EXCLUDE_NODE


def test_failed_submissions_back_off_count_against_the_budget_and_escalate(
    rc: RecoverySpec,
) -> None:
    """W2: the attempt whose submission failed is resubmitted after a growing pause, and
    failed resubmissions spend the restart budget until the run needs a person."""
    lost = Finding(kind=FindingKind.JOB_LOST, summary="job None lost: submit failed")

    def failed(n: int, ago: float) -> PastRemedy:
        return PastRemedy(
            RemedyKind.RESTART,
            attempt=n,
            at=NOW - ago,
            finding_kind=FindingKind.JOB_LOST,
            failed=True,
        )

    one = RunHistory(remedies=(failed(1, 5),), attempt_nodes=NODES)
    assert decide(snap_at(10, attempt=2), [lost], one, rc).kind is RemedyKind.NONE
    one = RunHistory(remedies=(failed(1, 15),), attempt_nodes=NODES)
    assert decide(snap_at(10, attempt=2), [lost], one, rc).kind is RemedyKind.RESTART
    two = RunHistory(remedies=(failed(1, 30), failed(2, 15)), attempt_nodes=NODES)
    assert decide(snap_at(10, attempt=3), [lost], two, rc).kind is RemedyKind.NONE  # 20 s now
    storm = RunHistory(
        remedies=tuple(failed(n, 600 - 60 * n) for n in range(1, rc.max_restarts + 1)),
        attempt_nodes=NODES,
    )
    r = decide(snap_at(10, attempt=rc.max_restarts + 1), [lost], storm, rc)
    assert r.kind is RemedyKind.ESCALATE


def test_nan_grads_recurring_right_after_their_skipped_window_suspect_a_node(
    rc: RecoverySpec,
) -> None:
    """W4: a node's NaN grads (finite loss) first look like bad data: rollback + skip. When
    they recur right after the skipped window, that is the node, not more bad data."""
    first = past(
        RemedyKind.ROLLBACK,
        FindingKind.NONFINITE,
        step=254,
        skip_ranges=((2000, 2032),),
        attempt_nodes=NODES,
    )
    hist = RunHistory(
        remedies=(first,), checkpoints=CKPTS, attempt_nodes=NODES, node_strikes={"n2": 1}
    )
    recur = Finding(
        kind=FindingKind.NONFINITE,
        summary="nan",
        last_healthy_step=250,
        first_bad_step=251,
        sample_window=(2032, 2040),
        evidence={"grads_only": True},
    )
    r = decide(snap_at(251), [recur], hist, rc)
    assert r.kind is RemedyKind.EXCLUDE_NODE and r.exclude_nodes == ("n2",)
    assert r.suspect is Cause.NODE
    bad_loss = dataclasses.replace(recur, evidence={"grads_only": False})
    assert decide(snap_at(251), [bad_loss], hist, rc).kind is RemedyKind.ROLLBACK


def test_nan_pinned_on_a_node_excludes_it_at_once_and_resumes_before_the_onset(
    rc: RecoverySpec,
) -> None:
    pinned = dataclasses.replace(nan_at(250, 254), cause=Cause.NODE, nodes=("n2",))
    r = decide(snap_at(255), [pinned], RunHistory(checkpoints=CKPTS, attempt_nodes=NODES), rc)
    assert r.kind is RemedyKind.EXCLUDE_NODE and r.exclude_nodes == ("n2",)
    assert r.suspect is Cause.NODE and r.to_step == 200


def test_a_numeric_fault_after_a_pinned_node_was_excluded_starts_its_own_ladder(
    rc: RecoverySpec,
) -> None:
    """The short soak's escalation: a NaN node excluded, then a poisoned window on the new
    nodes. The node explained the NaN; the spike is new data: rollback, not a node hunt."""
    excl = past(
        RemedyKind.EXCLUDE_NODE,
        FindingKind.NONFINITE,
        step=120,
        excluded=("n1",),
        attempt_nodes=("n1", "n2"),
        finding_nodes=("n1",),
    )
    hist = RunHistory(
        remedies=(excl,),
        excluded_nodes=frozenset({"n1"}),
        checkpoints=CKPTS,
        attempt_nodes=("n2", "n3"),
    )
    spike = dataclasses.replace(nan_at(250, 254), kind=FindingKind.LOSS_SPIKE)
    r = decide(snap_at(255), [spike], hist, rc)
    assert r.kind is RemedyKind.ROLLBACK and r.suspect is Cause.DATA


def test_recurrence_on_disjoint_nodes_is_a_new_bad_window(rc: RecoverySpec) -> None:
    """After a rollback, a numeric fault at other data on nodes the faulty attempt did not
    use: no node was in both, so it is data again (rollback), until the rollbacks run out."""
    first = past(
        RemedyKind.ROLLBACK,
        FindingKind.NONFINITE,
        step=254,
        skip_ranges=((2000, 2032),),
        attempt_nodes=("n3", "n4"),
    )
    hist = RunHistory(remedies=(first,), checkpoints=CKPTS, attempt_nodes=NODES)
    r = decide(snap_at(280), [nan_at(270, 272)], hist, rc)
    assert r.kind is RemedyKind.ROLLBACK and r.to_step == 200
    second = dataclasses.replace(first, at=NOW - 30, step=280, attempt_nodes=("n5", "n6"))
    worn = dataclasses.replace(hist, remedies=(first, second))
    assert decide(snap_at(290), [nan_at(285, 288)], worn, rc).kind is RemedyKind.ESCALATE


def test_nan_pinned_again_on_another_node_at_the_same_data_is_the_data(
    rc: RecoverySpec,
) -> None:
    """n1 was excluded for NaN gradients decided at step 260; the replay from 200 makes NaN
    at step 255 on n2: it followed the data (one shard's batch), so roll back and skip it
    instead of excluding healthy nodes one by one. Far past that step, n2 is a new bad node."""
    excl = past(
        RemedyKind.EXCLUDE_NODE,
        FindingKind.NONFINITE,
        step=260,
        excluded=("n1",),
        attempt_nodes=("n1", "n2"),
        finding_nodes=("n1",),
    )
    hist = RunHistory(
        remedies=(excl,), excluded_nodes=frozenset({"n1"}), checkpoints=CKPTS, attempt_nodes=NODES
    )
    again = dataclasses.replace(nan_at(250, 255), cause=Cause.NODE, nodes=("n2",))
    r = decide(snap_at(256), [again], hist, rc)
    assert r.kind is RemedyKind.ROLLBACK and r.skip_ranges and r.to_step == 200
    later = dataclasses.replace(nan_at(400, 405), cause=Cause.NODE, nodes=("n2",))
    assert decide(snap_at(406), [later], hist, rc).kind is RemedyKind.EXCLUDE_NODE


@pytest.mark.parametrize(
    ("slurm", "exit_code", "disk_step", "kind"),
    [
        (JobState.RUNNING, None, 10, RemedyKind.NONE),
        (JobState.TIMEOUT, None, 40, RemedyKind.REQUEUE),
        (JobState.DEADLINE, None, 40, RemedyKind.REQUEUE),
        (JobState.FAILED, 75, 40, RemedyKind.REQUEUE),  # checkpointed on a stop signal
        (JobState.PREEMPTED, None, None, RemedyKind.REQUEUE),
        (JobState.COMPLETED, 0, 50, RemedyKind.REQUEUE),  # stop_at_step short of the target
        (JobState.COMPLETED, 0, 100, RemedyKind.NONE),  # done: the reconciler completes the run
        (JobState.FAILED, 76, 40, RemedyKind.RESTART),
        (JobState.BOOT_FAIL, None, 40, RemedyKind.EXCLUDE_NODE),
        (JobState.NODE_FAIL, None, 40, RemedyKind.EXCLUDE_NODE),
        (JobState.CANCELLED, None, 40, RemedyKind.ESCALATE),
    ],
)
def test_an_ended_job_continues_only_after_a_checkpointed_stop(
    rc: RecoverySpec,
    slurm: JobState,
    exit_code: int | None,
    disk_step: int | None,
    kind: RemedyKind,
) -> None:
    """Walltime chaining: a time limit, a preemption, exit 75 or a clean stop short of the
    target continue as a new attempt from the newest checkpoint (REQUEUE); the target reached
    needs nothing; a failure is the policy's to cure, never a plain continuation."""
    snap = snapshot(
        [],
        job_state=slurm.attempt_state,
        exit_code=exit_code,
        failed_nodes=("n2",),
        disk_checkpoint_step=disk_step,
        target_steps=100,
    )
    remedy = decide(snap, detect_all(snap, rc), RunHistory(), rc)
    assert remedy.kind is kind, remedy
    if kind is RemedyKind.REQUEUE:
        assert remedy.to_step is None  # the trainer resumes from its newest checkpoint


def test_a_failed_first_submission_backs_off_then_resubmits_then_escalates(
    rc: RecoverySpec,
) -> None:
    """Every attempt of a pending run is a failed submission: retried after a backoff that
    doubles, until the restart budget is spent; then a person decides."""
    assert first_submit(1, "sbatch: error", 100.0, 105.0, rc).kind is RemedyKind.NONE
    assert first_submit(1, "sbatch: error", 100.0, 110.0, rc).kind is RemedyKind.RESTART
    assert first_submit(2, "sbatch: error", 100.0, 115.0, rc).kind is RemedyKind.NONE
    assert first_submit(2, "sbatch: error", 100.0, 120.0, rc).kind is RemedyKind.RESTART
    escalate = first_submit(rc.max_restarts, "sbatch: error", 100.0, 1e9, rc)
    assert escalate.kind is RemedyKind.ESCALATE and "sbatch: error" in escalate.reason


def test_after_a_rollback_every_resubmission_names_its_checkpoint(rc: RecoverySpec) -> None:
    restart = Remedy(RemedyKind.RESTART, "hang")
    assert resume_point(restart, None, 40).to_step is None
    assert resume_point(restart, 20, 40).to_step == 40
    assert resume_point(restart, 20, None).to_step == 0
    assert resume_point(Remedy(RemedyKind.OBSERVE, "slow"), 20, 40).to_step is None


def test_budget_left_counts_the_remedy_being_applied(rc: RecoverySpec) -> None:
    history = RunHistory()
    assert budget_left(history, rc, 0.0, 10, Remedy(RemedyKind.RESTART, "x")) == (
        rc.max_restarts - 1
    )
    assert budget_left(history, rc, 0.0, 10, Remedy(RemedyKind.OBSERVE, "x")) == rc.max_restarts
