"""Spares that refill (fake SLURM, real database): once a node fault used a job's spare, the
watchdog submits a reserve job whose nodes join the job as its spares; the next node fault
moves there inside the job. Recorded first, submitted once, cancelled once its job is gone.
The node tasks' side runs on the real cluster in tests/launcher/test_cluster_restart_in_job.py.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import select
from watchdog_curves import simulate
from watchdog_fakes import TINY_SPEC, Crash, FakeCluster, FakeSource, write_checkpoint

from contracts import anomalies
from contracts.paths import attempt_log_dir, checkpoint_dir, reserve_log_dir, run_dir
from contracts.restart import job_control_dir, read_order
from contracts.spec import RunSpec
from supervisor import store
from supervisor.db import Database
from supervisor.launcher import parse_reserve_name
from supervisor.models import Action, ActionState, Attempt, RunState
from supervisor.slurm import JobState, JobStatus, LiveJob
from supervisor.watchdog import actions, reconciler, reserves
from supervisor.watchdog.reconciler import Reconciler, WatchdogConfig
from supervisor.watchdog.reserves import Reserve
from supervisor.watchdog.snapshot import Remedy, RemedyKind
from supervisor.watchdog.strays import RunJobs, find_strays

SPEC = copy.deepcopy(TINY_SPEC)
SPEC["recovery"] = {"restart_in_job": True}
SPEC["resources"] = {**SPEC["resources"], "spare_nodes": 1}
#: n1, n2 train, n3 is the job's spare; n4, n5 are free for reserves.
CLUSTER = ("n1", "n2", "n3", "n4", "n5")


def make(db: Database, tmp_path: Path, cluster: FakeCluster, source: FakeSource) -> Reconciler:
    config = WatchdogConfig(home=tmp_path / "home", lease_ttl_s=60)
    return Reconciler(db, cluster, source, config, registry=CollectorRegistry())


def nan_on(ckpt: Path, attempt: int, node: str, steps: tuple[int, ...]) -> None:
    """The trainer's records: `node` made NaN gradients (finite losses) at `steps`."""
    for step in steps:
        anomalies.append(
            ckpt,
            anomalies.Anomaly(
                attempt, step, anomalies.NONFINITE, (), (node,), consumed=(8 * step - 8, 8 * step),
                update_skipped=True, t=time.time() - 60 + step,
            ),
        )  # fmt: skip


def reserve_actions(db: Database, run_id: str) -> list[Action]:
    with db.session() as s:
        return list(
            s.scalars(
                select(Action)
                .where(Action.run_id == run_id, Action.kind == actions.ActionKind.RESERVE)
                .order_by(Action.id)
            )
        )


def attempts(db: Database, run_id: str) -> list[Attempt]:
    with db.session() as s:
        return list(store.get_attempts(s, run_id))


class Swapped:
    """A run whose job (n1, n2 + spare n3) moved n2's ranks to n3 inside the job."""

    def __init__(self, db: Database, tmp_path: Path) -> None:
        self.db, self.home = db, tmp_path / "home"
        self.cluster, self.source = FakeCluster(nodes_per_job=CLUSTER), FakeSource()
        self.rec = make(db, tmp_path, self.cluster, self.source)
        with db.write_session() as s:
            self.run_id = store.create_run(s, RunSpec.model_validate(SPEC))[0].id
        self.rec.tick()
        self.job = self.cluster.submitted[-1][0]
        self.cluster.set(self.job, JobState.RUNNING)
        self.rec.tick()
        self.ckpt = checkpoint_dir(self.home, self.run_id, RunSpec.model_validate(SPEC))
        write_checkpoint(self.ckpt, 50, 400)
        self.source.samples[(self.run_id, 1)] = simulate(1, steps=70, steps_per_sample=2)
        nan_on(self.ckpt, 1, "n2", (61, 62))
        assert self.rec.tick().remedies[self.run_id].exclude_nodes == ("n2",)
        self.source.samples[(self.run_id, 2)] = simulate(2, steps=70, steps_per_sample=2)

    def order(self):
        return read_order(job_control_dir(run_dir(self.home, self.run_id), self.job))

    def reserve_running(self) -> str:
        """The reserve job the used spare calls for, submitted and started by SLURM."""
        self.rec.tick()
        reserve_id = self.cluster.submitted[-1][0]
        self.cluster.set(reserve_id, JobState.RUNNING)
        self.rec.tick()
        return reserve_id

    def nan_on_n1(self) -> Remedy:
        """n1 makes NaN past the steps n2's attempt reached: the next node fault."""
        self.source.samples[(self.run_id, 2)] = simulate(2, steps=90, steps_per_sample=2)
        write_checkpoint(self.ckpt, 80, 640)
        nan_on(self.ckpt, 2, "n1", (85, 86))
        remedy = self.rec.tick().remedies[self.run_id]
        self.source.samples[(self.run_id, 3)] = simulate(3, steps=90, steps_per_sample=2)
        return remedy


def test_a_used_spare_is_refilled_by_a_reserve_job_recorded_first(
    db: Database, tmp_path: Path
) -> None:
    w = Swapped(db, tmp_path)
    assert w.order().nodes == ("n1", "n3") and len(w.cluster.submitted) == 1
    w.rec.tick()  # the job's only spare runs ranks now
    assert len(w.cluster.submitted) == 2
    reserve_id, request = w.cluster.submitted[-1]
    assert request.job_name == f"nw-{w.run_id}-j{w.job}-r1"
    assert parse_reserve_name(request.job_name) == (w.run_id, w.job)
    assert request.nodes == 1 and request.no_kill
    # on no node of the job, nor on the one the run excluded
    assert {"n1", "n2", "n3"} <= set(request.exclude)
    assert request.log_dir == reserve_log_dir(w.home, w.run_id) / f"{w.job}-r1"
    task = w.cluster.tasks[reserve_id]
    assert task.reserve_for == w.job and task.nodes == ("n1", "n3")  # type: ignore[attr-defined]
    folder = attempt_log_dir(w.home, w.run_id, 2) / w.job
    assert task.job_folder == str(folder) and task.attempt == 2  # type: ignore[attr-defined]
    (action,) = reserve_actions(db, w.run_id)
    assert action.state is ActionState.DONE and action.attempt == 2
    assert action.target == f"{w.job}-r1" and action.result_json["job_id"] == reserve_id
    assert action.evidence_json["job_nodes"] == ["n1", "n2", "n3"]
    assert action.evidence_json["attempt_nodes"] == ["n1", "n3"]
    # pending, then not yet listed: a spare to come, never doubled
    w.rec.tick()
    w.cluster.states[reserve_id] = JobStatus(reserve_id, JobState.UNKNOWN)
    w.rec.tick()
    assert len(w.cluster.submitted) == 2 and len(reserve_actions(db, w.run_id)) == 1


def test_the_next_node_fault_moves_to_the_reserve_inside_the_job(
    db: Database, tmp_path: Path
) -> None:
    w = Swapped(db, tmp_path)
    reserve_id = w.reserve_running()
    assert w.cluster.states[reserve_id].nodes == ("n4",)
    assert len(w.cluster.submitted) == 2  # the reserve is the job's spare: nothing missing
    remedy = w.nan_on_n1()
    assert remedy.kind is RemedyKind.EXCLUDE_NODE and remedy.exclude_nodes == ("n1",)
    assert w.cluster.cancelled == [] and len(w.cluster.submitted) == 2  # no resubmission
    order = w.order()
    assert order is not None and order.attempt == 3 and order.nodes == ("n4", "n3")
    assert attempts(db, w.run_id)[-1].job_id == w.job
    assert attempts(db, w.run_id)[-1].nodes_json == ["n4", "n3"]
    w.rec.tick()  # spares used again: the next reserve excludes every node seen so far
    assert len(w.cluster.submitted) == 3
    _, request = w.cluster.submitted[-1]
    assert request.job_name == f"nw-{w.run_id}-j{w.job}-r2"
    assert {"n1", "n2", "n3", "n4"} <= set(request.exclude)


def test_a_stop_signal_cancels_the_idle_reserves_and_not_the_one_running_ranks(
    db: Database, tmp_path: Path
) -> None:
    """A second node fault moved the ranks onto the reserve's node n4; a stop signal then
    prepares the successor. The idle reserve (n5) makes way for it; the one running ranks
    is kept: the attempt trains on until the successor takes over."""
    w = Swapped(db, tmp_path)
    w.reserve_running()
    assert w.nan_on_n1().exclude_nodes == ("n1",)
    second = w.reserve_running()
    assert w.cluster.states[second].nodes == ("n5",)
    anomalies.append(w.ckpt, anomalies.Anomaly(3, 88, anomalies.STOP_SIGNAL, t=time.time()))
    w.rec.tick()
    successor, request = w.cluster.submitted[-1]
    assert request.job_name == f"nw-{w.run_id}-a4" and w.cluster.tasks[successor].standby
    assert w.cluster.cancelled == [second]


def test_reserves_of_a_job_the_run_left_are_cancelled(db: Database, tmp_path: Path) -> None:
    w = Swapped(db, tmp_path)
    w.rec.tick()
    reserve_id = w.cluster.submitted[-1][0]
    w.cluster.set(reserve_id, JobState.RUNNING)
    w.cluster.set(w.job, JobState.FAILED, exit_code=1)
    w.cluster.nodes_per_job = ("n5",)  # the resubmission gets a node nobody used
    w.rec.tick()
    assert reserve_id in w.cluster.cancelled
    (cancel,) = [
        a for a in _all_actions(db, w.run_id) if a.kind == "cancel" and a.target == reserve_id
    ]
    assert "reserve for job" in cancel.evidence_json["reason"]


def test_a_stopping_jobs_reserve_makes_way_for_its_successor(db: Database, tmp_path: Path) -> None:
    """The ranks stop on a signal: the successor is prepared, the reserve (whose node the
    successor may be waiting for) is cancelled as a stray in the same tick, recorded with
    its reason, and no new reserve refills the spares of a job that stops."""
    w = Swapped(db, tmp_path)
    reserve_id = w.reserve_running()
    anomalies.append(w.ckpt, anomalies.Anomaly(2, 80, anomalies.STOP_SIGNAL, t=time.time()))
    w.rec.tick()
    successor, request = w.cluster.submitted[-1]
    assert request.job_name == f"nw-{w.run_id}-a3" and w.cluster.tasks[successor].standby
    assert w.cluster.cancelled == [reserve_id]
    (cancel,) = [a for a in _all_actions(db, w.run_id) if a.kind == "cancel"]
    reason = f"reserve for job {w.job}, whose successor {successor} is prepared"
    assert (cancel.target, cancel.evidence_json["reason"]) == (reserve_id, reason)
    w.cluster.set(reserve_id, JobState.CANCELLED)
    w.rec.tick()
    w.rec.tick()
    assert len(w.cluster.submitted) == 3 and len(reserve_actions(db, w.run_id)) == 1


def test_a_successor_that_left_holds_refills_back_no_longer(db: Database, tmp_path: Path) -> None:
    """The job's time limit came near: its successor stands by, and the job gets no refill.
    The limit was then extended and the successor left without taking over (its standby
    wait ran out): refills go on for the job."""
    w = Swapped(db, tmp_path)
    near = 90 + reconciler.SUCCESSOR_SLACK_S
    w.cluster.states[w.job] = dataclasses.replace(w.cluster.states[w.job], time_left_s=near)
    w.rec.tick()
    successor, request = w.cluster.submitted[-1]
    assert request.job_name == f"nw-{w.run_id}-a3" and w.cluster.tasks[successor].standby
    w.rec.tick()
    assert len(w.cluster.submitted) == 2 and reserve_actions(db, w.run_id) == []
    w.cluster.states[w.job] = dataclasses.replace(w.cluster.states[w.job], time_left_s=3600.0)
    w.cluster.set(successor, JobState.COMPLETED)
    w.rec.tick()  # the tick's closing listing of live jobs finds the successor gone
    w.rec.tick()
    (reserve,) = reserve_actions(db, w.run_id)
    assert reserve.target == f"{w.job}-r1" and len(w.cluster.submitted) == 3


def _all_actions(db: Database, run_id: str) -> list[Action]:
    with db.session() as s:
        return list(s.scalars(select(Action).where(Action.run_id == run_id)))


def test_find_strays_judges_reserves_by_the_job_they_reserve_for() -> None:
    runs = {
        "r1": RunJobs(RunState.RUNNING, 2, "100"),
        "r2": RunJobs(RunState.SUCCEEDED, 1, "200"),
    }
    live = {
        "101": LiveJob("nw-r1-j100-r1"),  # the current job's: kept
        "102": LiveJob("nw-r1-j99-r1"),  # an earlier job's
        "201": LiveJob("nw-r2-j200-r1"),  # the run ended
        "301": LiveJob("nw-r3-j300-r1"),  # not this database's run
        "100": LiveJob("nw-r1-a2"),
    }
    strays = {s.job_id: s.reason for s in find_strays(live, runs)}
    assert set(strays) == {"102", "201"}
    assert strays["201"] == "run succeeded"
    # the job SLURM no longer runs (cancelled by an escalation, the run left as it was)
    del live["100"]
    assert {s.job_id for s in find_strays(live, runs)} == {"101", "102", "201"}


def test_a_reserve_is_a_stray_once_its_jobs_successor_is_prepared() -> None:
    """A job that stops soon (a walltime near, a stop signal) needs no more spares: its
    successor takes over, and on a full cluster it waits for the reserve's nodes."""
    runs = {"r1": RunJobs(RunState.RUNNING, 2, "100", ("n1", "n2"))}
    live = {
        "100": LiveJob("nw-r1-a2", ("n1", "n2", "n3")),
        "101": LiveJob("nw-r1-j100-r1", ("n4",)),
        "111": LiveJob("nw-r1-a4"),
    }
    assert find_strays(live, runs) == []  # a job named after a later attempt is no successor
    live["110"] = LiveJob("nw-r1-a3")  # attempt 3's standby job, prepared while attempt 2 runs
    assert [(s.job_id, s.reason) for s in find_strays(live, runs)] == [
        ("101", "reserve for job 100, whose successor 110 is prepared"),
    ]


def test_a_reserve_that_runs_the_attempts_ranks_outlives_the_successors_preparation() -> None:
    """Node faults moved the attempt's ranks onto a reserve's node (n4), then a stop signal
    came: cancelling that reserve would kill a rank of the attempt that trains on until the
    successor takes over (a crash, a restart, a hang). It ends with the attempt instead."""
    runs = {"r1": RunJobs(RunState.RUNNING, 2, "100", ("n1", "n4"))}
    live = {
        "100": LiveJob("nw-r1-a2", ("n1", "n2", "n3")),
        "101": LiveJob("nw-r1-j100-r1", ("n4",)),
        "102": LiveJob("nw-r1-j100-r2", ("n5",)),
        "110": LiveJob("nw-r1-a3"),
    }
    assert [s.job_id for s in find_strays(live, runs)] == ["102"]


@pytest.mark.parametrize("cut", ["before_submit", "after_submit"])
def test_a_reserve_cut_short_by_a_crash_is_submitted_exactly_once(
    db: Database, tmp_path: Path, cut: str
) -> None:
    w = Swapped(db, tmp_path)
    w.cluster.crash_before_submit = cut == "before_submit"
    w.cluster.crash_after_submit = cut == "after_submit"
    with pytest.raises(Crash):
        w.rec.tick()
    (intent,) = reserve_actions(db, w.run_id)
    assert intent.state is ActionState.INTENT  # recorded before SLURM was asked
    w.rec.tick()  # the next ticks resume it from the database and SLURM alone
    w.rec.tick()
    names = [r.job_name for _, r in w.cluster.submitted[1:]]
    assert names == [f"nw-{w.run_id}-j{w.job}-r1"]
    (done,) = reserve_actions(db, w.run_id)
    assert done.state is ActionState.DONE
    assert done.result_json["job_id"] == w.cluster.submitted[-1][0]


def _status(job_id: str, state: JobState, *nodes: str) -> JobStatus:
    return JobStatus(job_id, state, tuple(nodes))


def test_to_submit_counts_idle_spares_and_reserves_to_come() -> None:
    job, active = ("n1", "n2", "n3"), ("n1", "n3")
    done = Reserve(1, 1, ActionState.DONE, "7", attempt=2)

    def plan(spares: int, nodes=job, excluded=("n2",), rs=(), statuses=None, now=0.0):
        r = reserves.to_submit(spares, nodes, active, set(excluded), list(rs), statuses or {}, now)
        return None if r is None else (r.seq, r.count, r.attempt)

    assert plan(1) == (1, 1, None)  # not recorded yet: keyed by the current attempt
    assert plan(2, excluded=()) == (1, 1, None)  # n2 is idle, not bad
    assert plan(1, rs=[done]) is None  # not listed yet
    assert plan(1, rs=[done], statuses={"7": _status("7", JobState.PENDING)}) is None
    ended = {"7": _status("7", JobState.FAILED, "n9")}
    assert plan(1, rs=[done], statuses=ended) == (2, 1, None)
    running = {"7": _status("7", JobState.RUNNING, "n9")}
    assert reserves.running_nodes([done], running) == ("n9",)
    with_reserve = (*job, *reserves.running_nodes([done], running))
    assert plan(1, nodes=with_reserve, rs=[done], statuses=running) is None
    # an intent cut short is finished as recorded, under the attempt it was keyed by
    intent = Reserve(2, 3, ActionState.INTENT, attempt=2)
    assert plan(1, rs=[done, intent], statuses=ended) == (2, 3, 2)
    # at most MAX_RESERVES_PER_JOB within the window: a failing reserve is no submission loop,
    # and a job that runs for days refills after each node fault
    cap, window = reserves.MAX_RESERVES_PER_JOB, reserves.RESERVE_WINDOW_S
    many = [Reserve(i, 1, ActionState.FAILED, recorded_at=100.0 + i) for i in range(1, cap + 1)]
    assert plan(1, rs=many, now=100.0 + cap) is None
    assert plan(1, rs=many, now=100.5 + window) is None
    assert plan(1, rs=many, now=101.0 + window) == (cap + 1, 1, None)  # the first one aged out


def test_an_intent_left_by_an_earlier_attempt_of_the_job_is_finished_not_doubled(
    db: Database, tmp_path: Path
) -> None:
    """A reserve's intent recorded under attempt 2, then a restart inside the job (attempt
    3): the next refill finishes that intent, and only that one."""
    w = Swapped(db, tmp_path)
    w.cluster.crash_before_submit = True
    with pytest.raises(Crash):
        w.rec.tick()
    ctx = actions.ActContext(w.run_id, 2, w.job, True, job_running=True, attempt_nodes=("n1", "n3"))
    w.rec.actuator.restart_in_job(
        ctx, actions.InJob(w.job, ("n1", "n3")), resume_step=50, reason="a crash"
    )
    assert attempts(db, w.run_id)[-1].number == 3
    w.source.samples[(w.run_id, 3)] = simulate(3, steps=70, steps_per_sample=2)
    w.rec.tick()
    w.rec.tick()
    names = [r.job_name for _, r in w.cluster.submitted[1:]]
    assert names == [f"nw-{w.run_id}-j{w.job}-r1"]
    (done,) = reserve_actions(db, w.run_id)
    assert done.state is ActionState.DONE and done.attempt == 2
    task = w.cluster.tasks[w.cluster.submitted[-1][0]]
    assert task.attempt == 3  # type: ignore[attr-defined]  # a spare of the current attempt
