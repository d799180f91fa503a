"""The watchdog's restart inside the allocation (fake SLURM, real database): which remedies
restart a running job in place, what is recorded, and that a crash at any point neither loses
nor repeats the restart. The node tasks' side runs on the real cluster in
tests/launcher/test_cluster_restart_in_job.py."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import select
from watchdog_curves import Faults, simulate
from watchdog_fakes import TINY_SPEC, Crash, FakeCluster, FakeSource, write_checkpoint

from contracts import anomalies, exitcodes
from contracts.checkpoints import SaveTiming, write_save_timing
from contracts.paths import attempt_log_dir, checkpoint_dir, run_dir
from contracts.restart import exit_code_path, job_control_dir, read_order
from contracts.spec import RunSpec
from supervisor import store
from supervisor.db import Database
from supervisor.models import (
    Action,
    ActionState,
    Attempt,
    AttemptState,
    NodeActionKind,
    Run,
    RunState,
)
from supervisor.slurm import JobState, JobStatus
from supervisor.watchdog import actions, reconciler
from supervisor.watchdog.observe import LINGER_S
from supervisor.watchdog.reconciler import Reconciler, WatchdogConfig
from supervisor.watchdog.snapshot import FindingKind, RemedyKind

SPEC = copy.deepcopy(TINY_SPEC)
SPEC["recovery"] = {"restart_in_job": True}


def make(db: Database, tmp_path: Path, cluster: FakeCluster, source: FakeSource) -> Reconciler:
    config = WatchdogConfig(home=tmp_path / "home", lease_ttl_s=60)
    return Reconciler(db, cluster, source, config, registry=CollectorRegistry())


def running(
    db: Database, tmp_path: Path, spec: dict = SPEC, nodes: tuple[str, ...] = ("n1", "n2")
) -> tuple:
    """A run submitted and running as attempt 1 on `nodes`."""
    cluster, source = FakeCluster(nodes_per_job=nodes), FakeSource()
    rec = make(db, tmp_path, cluster, source)
    with db.write_session() as s:
        run_id = store.create_run(s, RunSpec.model_validate(spec))[0].id
    rec.tick()
    job = cluster.submitted[-1][0]
    cluster.set(job, JobState.RUNNING)
    rec.tick()
    return rec, cluster, source, run_id, job


def attempts(db: Database, run_id: str) -> list[Attempt]:
    with db.session() as s:
        return list(store.get_attempts(s, run_id))


def in_job_actions(db: Database, run_id: str) -> list[Action]:
    with db.session() as s:
        return list(
            s.scalars(
                select(Action).where(
                    Action.run_id == run_id, Action.kind == actions.ActionKind.RESTART_IN_JOB
                )
            )
        )


def get_run(db: Database, run_id: str) -> Run:
    with db.session() as s:
        return store.get_run(s, run_id)


def nan_from_121(source: FakeSource, run_id: str) -> None:
    source.samples[(run_id, 1)] = simulate(
        1, steps=130, steps_per_sample=2, faults=Faults(nan_from=121)
    )


def test_a_rollback_restarts_the_running_job_in_place(db: Database, tmp_path: Path) -> None:
    rec, cluster, source, run_id, job = running(db, tmp_path)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(SPEC))
    for step in (50, 100):
        write_checkpoint(ckpt, step, step * 8)
    nan_from_121(source, run_id)
    remedy = rec.tick().remedies[run_id]
    assert remedy.kind is RemedyKind.ROLLBACK and remedy.to_step == 100
    assert cluster.cancelled == [] and len(cluster.submitted) == 1  # no scancel, no sbatch
    first, second = attempts(db, run_id)
    assert (
        first.state is AttemptState.CANCELLED and first.end_reason == f"restarted inside job {job}"
    )
    assert second.number == 2 and second.job_id == job and second.resume_step == 100
    order = read_order(job_control_dir(run_dir(tmp_path / "home", run_id), job))
    assert order is not None and order.attempt == 2 and order.resume_step == 100
    assert order.skip_ranges == ((960, 976),)
    assert order.log_dir == str(attempt_log_dir(tmp_path / "home", run_id, 2))
    (action,) = in_job_actions(db, run_id)
    assert action.state is ActionState.DONE and action.target == job
    assert action.evidence_json["skip_ranges"] == [[960, 976]]
    # The next ticks see attempt 2 running on the same job, and restart nothing more.
    rec.tick()
    rec.tick()
    assert len(in_job_actions(db, run_id)) == 1 and len(cluster.submitted) == 1
    assert attempts(db, run_id)[-1].state is AttemptState.RUNNING
    assert get_run(db, run_id).current_attempt == 2


def ranks_exited(tmp_path: Path, run_id: str, job: str, codes: dict[int, int]) -> None:
    """Attempt 1's ranks in `job` recorded these exit codes (rank → code), as node tasks do."""
    folder = attempt_log_dir(tmp_path / "home", run_id, 1) / job
    folder.mkdir(parents=True, exist_ok=True)
    for rank, code in codes.items():
        exit_code_path(folder, job, rank).write_text(str(code))


def ranks_failed(tmp_path: Path, run_id: str, job: str) -> None:
    """Attempt 1's ranks in `job` ended with failures (rank 1 killed, rank 0 after it)."""
    ranks_exited(tmp_path, run_id, job, {1: 9, 0: 1})


def test_ranks_that_failed_in_a_running_job_are_restarted_inside_it(
    db: Database, tmp_path: Path
) -> None:
    rec, cluster, _source, run_id, job = running(db, tmp_path)
    ranks_failed(tmp_path, run_id, job)
    result = rec.tick()
    assert [f.kind for f in result.findings[run_id]] == [FindingKind.JOB_FAILED]
    assert result.remedies[run_id].kind is RemedyKind.RESTART
    first, second = attempts(db, run_id)
    assert first.state is AttemptState.FAILED and first.exit_code in (1, 9)
    assert second.job_id == job and cluster.cancelled == [] and len(cluster.submitted) == 1
    order = read_order(job_control_dir(run_dir(tmp_path / "home", run_id), job))
    assert order is not None and order.attempt == 2


def test_a_node_fault_still_resubmits_without_the_node(db: Database, tmp_path: Path) -> None:
    rec, cluster, _source, run_id, job = running(db, tmp_path)
    cluster.nodes_per_job = ("n1", "n2", "n3")  # a spare
    cluster.states[job] = JobStatus(job, JobState.NODE_FAIL, ("n1", "n2"), failed_nodes=("n2",))
    remedy = rec.tick().remedies[run_id]
    assert remedy.kind is RemedyKind.EXCLUDE_NODE
    assert len(cluster.submitted) == 2 and "n2" in cluster.submitted[-1][1].exclude
    assert in_job_actions(db, run_id) == []


def test_restart_in_job_off_resubmits(db: Database, tmp_path: Path) -> None:
    rec, cluster, source, run_id, job = running(db, tmp_path, TINY_SPEC)
    nan_from_121(source, run_id)
    assert rec.tick().remedies[run_id].kind is RemedyKind.ROLLBACK
    assert cluster.cancelled == [job] and len(cluster.submitted) == 2
    assert in_job_actions(db, run_id) == []


@pytest.mark.parametrize("cut", ["before_order", "after_order"])
def test_a_supervisor_killed_mid_restart_finishes_it_once(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    rec, cluster, source, run_id, job = running(db, tmp_path)
    nan_from_121(source, run_id)
    real = actions.write_order

    def crashing(control: Path, order: object) -> Path:
        if cut == "after_order":
            real(control, order)  # type: ignore[arg-type]
        raise Crash

    monkeypatch.setattr(actions, "write_order", crashing)
    with pytest.raises(Crash):
        rec.tick()
    monkeypatch.setattr(actions, "write_order", real)
    # The next ticks (a restarted supervisor reads only the database and the files) resume
    # the unfinished remedy.
    rec.tick()
    rec.tick()
    (action,) = in_job_actions(db, run_id)
    assert action.state is ActionState.DONE
    assert [a.number for a in attempts(db, run_id)] == [1, 2]
    assert attempts(db, run_id)[-1].job_id == job
    assert cluster.cancelled == [] and len(cluster.submitted) == 1
    order = read_order(job_control_dir(run_dir(tmp_path / "home", run_id), job))
    assert order is not None and order.attempt == 2
    assert get_run(db, run_id).state in (RunState.RECOVERING, RunState.RUNNING)


SPARE_SPEC = copy.deepcopy(SPEC)
SPARE_SPEC["resources"] = {**SPEC["resources"], "spare_nodes": 1}


def nan_on(ckpt: Path, node: str, steps: tuple[int, ...]) -> None:
    """The trainer's records: `node` made NaN gradients (finite losses) at `steps`."""
    for step in steps:
        anomalies.append(
            ckpt,
            anomalies.Anomaly(
                1, step, anomalies.NONFINITE, (), (node,), consumed=(8 * step - 8, 8 * step),
                update_skipped=True, t=time.time() - 60 + step,
            ),
        )  # fmt: skip


def test_swap_in_spares_keeps_rank_order_and_runs_short_honestly() -> None:
    job = ("n1", "n2", "n3", "n4")
    assert actions.swap_in_spares(("n1", "n2"), job, ("n1",), ()) == ("n3", "n2")
    assert actions.swap_in_spares(("n1", "n2"), job, ("n2",), ("n3",)) == ("n1", "n4")
    assert actions.swap_in_spares(("n1", "n2"), job, ("n1", "n2"), ("n3",)) is None


def test_a_bad_node_is_swapped_for_the_jobs_spare_inside_the_job(
    db: Database, tmp_path: Path
) -> None:
    rec, cluster, source, run_id, job = running(db, tmp_path, SPARE_SPEC, ("n1", "n2", "n3"))
    assert cluster.submitted[-1][1].nodes == 3  # two that train and one spare
    assert attempts(db, run_id)[0].nodes_json == ["n1", "n2"]  # the spare runs no ranks
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(SPARE_SPEC))
    write_checkpoint(ckpt, 50, 400)
    source.samples[(run_id, 1)] = simulate(1, steps=70, steps_per_sample=2)
    nan_on(ckpt, "n2", (61, 62))
    remedy = rec.tick().remedies[run_id]
    assert remedy.kind is RemedyKind.EXCLUDE_NODE and remedy.exclude_nodes == ("n2",)
    assert cluster.cancelled == [] and len(cluster.submitted) == 1  # no queue wait
    order = read_order(job_control_dir(run_dir(tmp_path / "home", run_id), job))
    assert order is not None and order.attempt == 2 and order.nodes == ("n1", "n3")
    assert order.resume_step == 50
    second = attempts(db, run_id)[-1]
    assert second.job_id == job and second.nodes_json == ["n1", "n3"]
    assert get_run(db, run_id).excluded_nodes_json == ["n2"]  # the next sbatch avoids it
    rec.tick()
    assert attempts(db, run_id)[-1].nodes_json == ["n1", "n3"]


@pytest.mark.parametrize("taken_out_by", ["run", "operator"])
def test_a_bad_node_without_a_spare_left_resubmits(
    db: Database, tmp_path: Path, taken_out_by: str
) -> None:
    """The job's only spare is out: the run excluded it before (it went bad), or an operator
    took it out of the fleet. A node fault does not move onto it inside the job; it resubmits
    (as the refill of spares counts it out too)."""
    rec, cluster, source, run_id, job = running(db, tmp_path, SPARE_SPEC, ("n1", "n2", "n3"))
    rec.tick()  # the leader lists the cluster's nodes
    with db.write_session() as s:
        if taken_out_by == "run":
            store.update_run(s, run_id, excluded_nodes_json=["n3"])
        else:
            store.request_node_action(s, "n3", NodeActionKind.EXCLUDE, by="oncall", reason="ecc")
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(SPARE_SPEC))
    write_checkpoint(ckpt, 50, 400)
    source.samples[(run_id, 1)] = simulate(1, steps=70, steps_per_sample=2)
    nan_on(ckpt, "n2", (61, 62))
    cluster.nodes_per_job = ("n1", "n2", "n3", "n4", "n5")  # free nodes for the new job
    assert rec.tick().remedies[run_id].kind is RemedyKind.EXCLUDE_NODE
    assert cluster.cancelled == [job] and len(cluster.submitted) == 2
    assert in_job_actions(db, run_id) == []
    assert {"n2", "n3"} <= set(cluster.submitted[-1][1].exclude)


def test_ranks_that_all_checkpointed_on_a_stop_signal_are_requeued_before_slurm_ends_the_job(
    db: Database, tmp_path: Path
) -> None:
    """A walltime or preemption warning: every rank saved and exited 75 while SLURM still
    lists the job for its node tasks' last moments. The attempt has ended to be requeued: the
    next job is submitted at that tick (the ending job cancelled first, as every job SLURM
    still lists is before a resubmission). Before the last rank's code (it may still be
    saving), nothing of the sort."""
    rec, cluster, _source, run_id, job = running(db, tmp_path)
    spec = RunSpec.model_validate(SPEC)
    write_checkpoint(checkpoint_dir(tmp_path / "home", run_id, spec), 300, 2400)
    last = spec.resources.world_size - 1
    ranks_exited(tmp_path, run_id, job, dict.fromkeys(range(last), exitcodes.REQUEUE))
    rec.tick()
    assert len(cluster.submitted) == 1 and attempts(db, run_id)[0].state is AttemptState.RUNNING
    ranks_exited(tmp_path, run_id, job, {last: 0})  # a rank at its last step finished: a requeue
    result = rec.tick()
    assert result.remedies[run_id].kind is RemedyKind.REQUEUE
    assert len(cluster.submitted) == 2 and cluster.cancelled == [job]
    first, second = attempts(db, run_id)
    assert (first.state, first.exit_code) == (AttemptState.PREEMPTED, 75)
    assert first.end_reason.startswith("every rank checkpointed on a stop signal (exit 75)")
    assert second.number == 2 and second.job_id == cluster.submitted[-1][0]


def test_a_job_whose_ranks_all_finished_but_lingers_completes_the_run(
    db: Database, tmp_path: Path
) -> None:
    """A job that holds spares runs --no-kill: when a dead node was its batch host, SLURM
    runs the job on after every rank finished. A run whose ranks all exited 0 LINGER_S ago
    is complete, and its job is cancelled as a stray; one that finished just now, or whose
    ranks did not all exit 0, waits for SLURM."""
    rec, cluster, _source, run_id, job = running(db, tmp_path, SPARE_SPEC, ("n1", "n2", "n3"))
    spec = RunSpec.model_validate(SPARE_SPEC)
    write_checkpoint(checkpoint_dir(tmp_path / "home", run_id, spec), 300, 2400)
    folder = attempt_log_dir(tmp_path / "home", run_id, 1) / job
    folder.mkdir(parents=True)
    codes = [exit_code_path(folder, job, rank) for rank in range(spec.resources.world_size)]
    for path in codes:
        path.write_text("0")
    rec.tick()
    assert get_run(db, run_id).state is RunState.RUNNING  # finished just now: SLURM ends it
    codes[0].unlink()  # one rank not ended yet
    for path in codes[1:]:
        os.utime(path, (time.time() - LINGER_S, time.time() - LINGER_S))
    rec.tick()
    assert get_run(db, run_id).state is RunState.RUNNING and cluster.cancelled == []
    codes[0].write_text("0")
    os.utime(codes[0], (time.time() - LINGER_S, time.time() - LINGER_S))
    rec.tick()
    assert get_run(db, run_id).state is RunState.SUCCEEDED
    assert attempts(db, run_id)[-1].state is AttemptState.COMPLETED
    assert cluster.cancelled == [job]


def stop_signal_at(ckpt: Path, step: int, attempt: int = 1) -> None:
    """The trainer's record: the ranks learned of a stop signal at `step` and save there."""
    anomalies.append(ckpt, anomalies.Anomaly(attempt, step, anomalies.STOP_SIGNAL, t=time.time()))


def successor_actions(db: Database, run_id: str) -> list[Action]:
    with db.session() as s:
        kind = actions.ActionKind.PREPARE_SUCCESSOR
        return list(s.scalars(select(Action).where(Action.run_id == run_id, Action.kind == kind)))


def stopping(db: Database, tmp_path: Path) -> tuple:
    """Attempt 1 running, a checkpoint at step 300, and the ranks stopping on a signal there."""
    rec, cluster, _source, run_id, job = running(db, tmp_path)
    spec = RunSpec.model_validate(SPEC)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, spec)
    write_checkpoint(ckpt, 300, 2400)
    stop_signal_at(ckpt, 300)
    return rec, cluster, run_id, job, spec


def all_checkpointed(tmp_path: Path, run_id: str, job: str, spec: RunSpec) -> None:
    every_rank = range(spec.resources.world_size)
    ranks_exited(tmp_path, run_id, job, dict.fromkeys(every_rank, exitcodes.REQUEUE))


def test_a_stop_signal_prepares_the_next_job_and_the_requeue_starts_it_by_order(
    db: Database, tmp_path: Path
) -> None:
    """The ranks record a stop signal: the next attempt's job is submitted at that tick as a
    standby job (no attempt yet: the run stays on attempt 1 while it saves), once. When the
    ranks have all checkpointed, the requeue cancels the ending job and starts attempt 2 in
    the standby job by an order, with no second sbatch; the standby job is no stray."""
    rec, cluster, run_id, job, spec = stopping(db, tmp_path)
    rec.tick()
    assert len(cluster.submitted) == 2
    successor, request = cluster.submitted[-1]
    assert request.job_name.endswith("-a2")
    task = cluster.tasks[successor]
    assert task.standby and task.attempt == 2 and task.standby_wait_s > 0
    assert [a.number for a in attempts(db, run_id)] == [1]
    (prepared,) = successor_actions(db, run_id)
    assert prepared.state is ActionState.DONE and prepared.result_json["job_id"] == successor
    cluster.set(successor, JobState.RUNNING)
    rec.tick()
    assert len(cluster.submitted) == 2 and cluster.cancelled == []  # once, and kept
    all_checkpointed(tmp_path, run_id, job, spec)
    assert rec.tick().remedies[run_id].kind is RemedyKind.REQUEUE
    assert len(cluster.submitted) == 2 and cluster.cancelled == [job]
    first, second = attempts(db, run_id)
    assert (first.state, first.exit_code) == (AttemptState.PREEMPTED, 75)
    assert second.job_id == successor
    order = read_order(job_control_dir(run_dir(tmp_path / "home", run_id), successor))
    assert order is not None and order.attempt == 2 and order.resume_step is None
    rec.tick()
    assert cluster.cancelled == [job] and get_run(db, run_id).current_attempt == 2


def test_ranks_that_fail_while_their_job_stops_restart_in_its_successor(
    db: Database, tmp_path: Path
) -> None:
    """A rank crashed while the ranks trained on through a stop signal: the next attempt
    starts in the prepared successor by an order, not inside the ending job (whose new
    ranks would not know of the signal), and the ending job is stopped."""
    rec, cluster, run_id, job, _spec = stopping(db, tmp_path)
    rec.tick()
    successor = cluster.submitted[-1][0]
    cluster.set(successor, JobState.RUNNING)
    ranks_failed(tmp_path, run_id, job)
    assert rec.tick().remedies[run_id].kind is RemedyKind.RESTART
    assert len(cluster.submitted) == 2 and cluster.cancelled == [job]
    first, second = attempts(db, run_id)
    assert first.state is AttemptState.FAILED and second.job_id == successor
    order = read_order(job_control_dir(run_dir(tmp_path / "home", run_id), successor))
    assert order is not None and order.attempt == 2
    assert read_order(job_control_dir(run_dir(tmp_path / "home", run_id), job)) is None
    (action,) = in_job_actions(db, run_id)
    assert action.target == successor


def test_a_standby_job_slurm_no_longer_holds_is_not_taken(db: Database, tmp_path: Path) -> None:
    """A standby job that ended (its wait ran out, or it was cancelled) is not the next
    attempt's: the requeue submits anew and does not adopt it by its name."""
    rec, cluster, run_id, job, spec = stopping(db, tmp_path)
    rec.tick()
    successor = cluster.submitted[-1][0]
    cluster.set(successor, JobState.COMPLETED, exit_code=0)
    all_checkpointed(tmp_path, run_id, job, spec)
    assert rec.tick().remedies[run_id].kind is RemedyKind.REQUEUE
    assert len(cluster.submitted) == 3
    fresh, request = cluster.submitted[-1]
    assert not cluster.tasks[fresh].standby and request.job_name.endswith("-a2")
    assert attempts(db, run_id)[-1].job_id == fresh


@pytest.mark.parametrize("cut", ["before_submit", "after_submit"])
def test_a_supervisor_killed_while_preparing_the_successor_submits_it_once(
    db: Database, tmp_path: Path, cut: str
) -> None:
    rec, cluster, run_id, _job, _spec = stopping(db, tmp_path)
    cluster.crash_before_submit = cut == "before_submit"
    cluster.crash_after_submit = cut == "after_submit"
    with pytest.raises(Crash):
        rec.tick()
    rec.tick()  # the next ticks resume the unfinished preparation
    rec.tick()
    assert len(cluster.submitted) == 2
    (prepared,) = successor_actions(db, run_id)
    assert prepared.state is ActionState.DONE
    assert prepared.result_json["job_id"] == cluster.submitted[-1][0]
    assert [a.number for a in attempts(db, run_id)] == [1]


def test_without_prepare_successor_a_stop_signal_submits_nothing_early(
    db: Database, tmp_path: Path
) -> None:
    spec_dict = copy.deepcopy(SPEC)
    spec_dict["recovery"] = {"restart_in_job": True, "prepare_successor": False}
    rec, cluster, _source, run_id, _job = running(db, tmp_path, spec_dict)
    spec = RunSpec.model_validate(spec_dict)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, spec)
    write_checkpoint(ckpt, 300, 2400)
    stop_signal_at(ckpt, 300)
    rec.tick()
    assert len(cluster.submitted) == 1 and successor_actions(db, run_id) == []


def test_a_time_limit_near_prepares_the_next_job_before_the_stop_signal(
    db: Database, tmp_path: Path
) -> None:
    """The job's time left, within its stop signal's lead (90 s before any save was
    measured) plus the run's start-up plus the slack: the successor is prepared before the
    signal comes; further away, not yet."""
    rec, cluster, _source, run_id, job = running(db, tmp_path)
    far = 90 + reconciler.SUCCESSOR_SLACK_S + 5
    cluster.states[job] = dataclasses.replace(cluster.states[job], time_left_s=far)
    rec.tick()
    assert len(cluster.submitted) == 1 and successor_actions(db, run_id) == []
    cluster.states[job] = dataclasses.replace(cluster.states[job], time_left_s=far - 10)
    rec.tick()
    assert len(cluster.submitted) == 2
    assert cluster.tasks[cluster.submitted[-1][0]].standby
    (prepared,) = successor_actions(db, run_id)
    assert prepared.evidence_json["reason"] == f"the job's time limit is {far - 10:.0f} s away"


def test_the_time_limit_is_judged_by_the_lead_the_job_was_submitted_with(
    db: Database, tmp_path: Path
) -> None:
    """A save measured since the submission would give a shorter lead (60 s) now; the job's
    signal still comes at the lead it was submitted with (90 s, none measured then), so the
    successor is prepared by that one."""
    rec, cluster, _source, run_id, job = running(db, tmp_path)
    spec = RunSpec.model_validate(SPEC)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, spec)
    write_save_timing(ckpt, SaveTiming(step=10, seconds=0.2, stall_seconds=0.2, step_seconds=0.1))
    left = 60 + reconciler.SUCCESSOR_SLACK_S + 10  # beyond what the measured lead would want
    cluster.states[job] = dataclasses.replace(cluster.states[job], time_left_s=left)
    rec.tick()
    assert len(cluster.submitted) == 2 and len(successor_actions(db, run_id)) == 1
