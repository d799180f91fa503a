"""An operator's exclude / restore of a node, carried out by the reconciler: the next
submission of every run avoids an excluded node; a restore undoes the watchdog's exclusions
and Nightwatch's drain, once, even when the supervisor dies between the undrain and its
record."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_watchdog_reconciler import get_run, make, new_run, rows, running
from watchdog_fakes import TINY_SPEC, FakeCluster, FakeSource

from supervisor import store
from supervisor.db import Database
from supervisor.metrics_in.types import SourceHealth
from supervisor.models import ActionState, Attempt, Event, NodeAction, NodeActionKind
from supervisor.slurm import JobState
from supervisor.store import Conflict, NotFound
from supervisor.watchdog.actions import ActContext
from supervisor.watchdog.snapshot import JobView, Remedy, RemedyKind


def _request(db: Database, node: str, kind: NodeActionKind, reason: str = "ecc") -> dict:
    with db.write_session() as s:
        return store.request_node_action(s, node, kind, by="oncall", reason=reason)


def _node(db: Database, node: str) -> dict:
    with db.session() as s:
        return store.get_node(s, node)


def test_an_excluded_node_is_what_every_next_submission_avoids(
    db: Database, tmp_path: Path
) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, first, job = running(db, tmp_path, cluster, source)
    with pytest.raises(NotFound, match="n7 is not known"):
        _request(db, "n7", NodeActionKind.EXCLUDE)
    pending = _request(db, "n2", NodeActionKind.EXCLUDE)
    assert pending["pending"]["kind"] == "exclude" and not pending["excluded"]
    with pytest.raises(Conflict, match="pending exclude by oncall"):
        _request(db, "n2", NodeActionKind.RESTORE)
    second = new_run(db)
    rec.tick()  # the exclusion first, then the new run's submission
    node = _node(db, "n2")
    assert (node["excluded"], node["excluded_by"], node["health"]) == (True, "oncall", "excluded")
    assert node["pending"] is None and node["actions"][0]["state"] == "done"
    assert node["reason"] == "exclude by oncall: ecc" and node["strikes"] == 0
    assert cluster.submitted[-1][1].exclude == ("n2",)
    assert rows(db, Attempt, second)[-1].exclude_json == ["n2"]
    assert cluster.cancelled == [] and get_run(db, first).current_attempt == 1  # left running
    with pytest.raises(Conflict, match="already excluded"):
        _request(db, "n2", NodeActionKind.EXCLUDE)

    # the running run's next attempt avoids it too
    ctx = ActContext(run_id=first, attempt=1, job_id=job, job_active=True)
    assert rec.actuator.apply(ctx, Remedy(RemedyKind.RESTART, "crash"))
    assert cluster.submitted[-1][1].exclude == ("n2",)

    _request(db, "n2", NodeActionKind.RESTORE)
    rec.tick()
    assert not _node(db, "n2")["excluded"] and _node(db, "n2")["health"] == "healthy"
    third = new_run(db)
    rec.tick()
    assert cluster.submitted[-1][1].exclude == ()
    assert rows(db, Attempt, third)[-1].exclude_json == []
    with pytest.raises(Conflict, match="not excluded: nothing to restore"):
        _request(db, "n2", NodeActionKind.RESTORE)


def test_restore_undoes_the_watchdogs_exclusion_and_drain_once_across_a_crash(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, source = FakeCluster(), FakeSource()
    spec = {**TINY_SPEC, "recovery": {"drain_excluded_nodes": True}}
    spec["resources"] = {**TINY_SPEC["resources"], "exclude": ["n9"]}
    rec = make(db, tmp_path, cluster, source)
    run_id = new_run(db, spec)
    rec.tick()
    job = cluster.submitted[-1][0]
    cluster.set(job, JobState.RUNNING)
    rec.tick()
    ctx = ActContext(run_id=run_id, attempt=1, job_id=job, job_active=True,
                     attempt_nodes=("n1", "n2"))  # fmt: skip
    remedy = Remedy(RemedyKind.EXCLUDE_NODE, "NaN gradients on n2", exclude_nodes=("n2",))
    assert rec.actuator.apply(ctx, remedy)
    assert cluster.drained == ["n2"] and cluster.drain_reasons["n2"].startswith("nightwatch:")
    assert get_run(db, run_id).excluded_nodes_json == ["n2", "n9"]
    node = _node(db, "n2")
    assert (node["health"], node["strikes"], node["excluded"]) == ("excluded", 1, False)
    assert node["excluded_by_runs"] == [run_id]
    assert [i["run_id"] for i in node["indicted_by"]] == [run_id]
    with pytest.raises(Conflict, match="not excluded"):  # a spec's own exclusion is not ours
        _request(db, "n9", NodeActionKind.RESTORE)

    _request(db, "n2", NodeActionKind.RESTORE, reason="DIMM replaced")

    def killed(*_args: object, **_kw: object) -> None:
        raise RuntimeError("supervisor killed")

    monkeypatch.setattr(store, "finish_node_action", killed)
    rec.tick()  # undrained in SLURM, the outcome not recorded
    assert cluster.resumed == ["n2"] and _node(db, "n2")["pending"] is not None
    monkeypatch.undo()
    rec.tick()  # SLURM no longer shows Nightwatch's drain: recorded, not resumed twice
    assert cluster.resumed == ["n2"]
    node = _node(db, "n2")
    assert (node["health"], node["strikes"], node["excluded_by_runs"]) == ("healthy", 1, [])
    (action,) = node["actions"]
    assert action["state"] == "done" and action["result"]["runs"] == [run_id]
    assert get_run(db, run_id).excluded_nodes_json == ["n9"]
    assert any("node n2 restore by oncall: DIMM replaced" in e.message
               for e in rows(db, Event, run_id))  # fmt: skip


def test_a_restore_waits_for_slurm_and_leaves_other_drains_alone(
    db: Database, tmp_path: Path
) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, _, _ = running(db, tmp_path, cluster, source)
    cluster.drain_reasons["n1"] = "admin: bad fan"  # drained by someone else
    _request(db, "n1", NodeActionKind.EXCLUDE)
    rec.tick()
    _request(db, "n1", NodeActionKind.RESTORE)
    cluster.down = True
    rec.tick()
    assert _node(db, "n1")["pending"]["kind"] == "restore"
    cluster.down = False
    rec.tick()
    assert _node(db, "n1")["pending"] is None and not _node(db, "n1")["excluded"]
    assert cluster.resumed == []
    with db.session() as s:
        states = [a.state for a in s.query(NodeAction).order_by(NodeAction.id)]
    assert states == [ActionState.DONE, ActionState.DONE]


def test_a_node_slurm_lists_can_be_excluded_before_any_job_ran_there(
    db: Database, tmp_path: Path
) -> None:
    cluster, source = FakeCluster(nodes_per_job=("n1", "n3")), FakeSource()
    rec = make(db, tmp_path, cluster, source)
    with pytest.raises(NotFound, match="n3 is not known"):
        _request(db, "n3", NodeActionKind.EXCLUDE)
    rec.tick()  # the leader lists the cluster's nodes
    assert (_node(db, "n3")["health"], _node(db, "n3")["strikes"]) == ("healthy", 0)
    _request(db, "n3", NodeActionKind.EXCLUDE)
    new_run(db)
    rec.tick()
    assert cluster.submitted[-1][1].exclude == ("n3",)


def test_the_policy_counts_no_spare_capacity_on_an_excluded_node(
    db: Database, tmp_path: Path
) -> None:
    """A node out of the fleet is no spare: the policy's usable nodes leave it out (so an
    exclusion that would need it as the replacement escalates), and the run's own exclusion
    budget is not charged for it."""
    cluster = FakeCluster(nodes_per_job=("n1", "n2", "n3"))
    rec, run_id, _ = running(db, tmp_path, cluster, FakeSource())
    job = JobView(SourceHealth.UP, nodes=("n1", "n2"))
    assert rec.observer.history(get_run(db, run_id), job, (), 2).usable_nodes == {
        "n1", "n2", "n3"}  # fmt: skip
    _request(db, "n3", NodeActionKind.EXCLUDE)
    rec.tick()
    history = rec.observer.history(get_run(db, run_id), job, (), 2)
    assert history.usable_nodes == {"n1", "n2"} and history.excluded_nodes == frozenset()
