"""Operator requests (resume, roll back) carried out by the reconciler through the actuator:
once, intent first, and not again after a supervisor killed between the action and the
clearing of the request."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_watchdog_reconciler import get_run, make, new_run, rows, running
from watchdog_fakes import TINY_SPEC, FakeCluster, FakeSource, write_checkpoint

from contracts.paths import checkpoint_dir
from contracts.spec import RunSpec
from supervisor import store
from supervisor.db import Database
from supervisor.models import Action, Event, RunState
from supervisor.slurm import JobState
from supervisor.store import Conflict
from supervisor.watchdog.actions import ActContext
from supervisor.watchdog.snapshot import Remedy, RemedyKind


def _request(db: Database, run_id: str, kind: str, **fields: object) -> None:
    with db.write_session() as s:
        store.request_operator_action(s, run_id, kind, by="oncall", **fields)


def test_resume_from_needs_attention_starts_one_new_attempt(db: Database, tmp_path: Path) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, _ = running(db, tmp_path, cluster, source)
    with pytest.raises(Conflict, match="resume needs it needs_attention"):
        _request(db, run_id, "resume")
    with db.write_session() as s:
        store.transition_run(s, run_id, RunState.NEEDS_ATTENTION, reason="escalated")
    _request(db, run_id, "resume")
    with pytest.raises(Conflict, match="pending resume by oncall"):
        _request(db, run_id, "resume")
    rec.tick()
    run = get_run(db, run_id)
    assert run.state is RunState.RECOVERING and run.current_attempt == 2
    assert run.operator_request_json is None
    assert len(cluster.submitted) == 2
    (action,) = [a for a in rows(db, Action, run_id) if a.target.startswith("operator:")]
    assert action.kind == "restart"
    assert action.evidence_json["reason"] == "operator resume by oncall"
    assert any("resume requested by oncall" in e.message for e in rows(db, Event, run_id))
    rec.tick()
    assert len(cluster.submitted) == 2


def test_rollback_skips_the_named_samples_and_survives_a_crash_before_clearing(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, run_id, _ = running(db, tmp_path, cluster, source)
    ckpt = checkpoint_dir(tmp_path / "home", run_id, RunSpec.model_validate(TINY_SPEC))
    write_checkpoint(ckpt, 20, 160)
    rec.tick()  # records the checkpoint
    with pytest.raises(Conflict, match="no complete checkpoint at step 30"):
        _request(db, run_id, "rollback", to_step=30)
    _request(db, run_id, "rollback", to_step=20, skip_ranges=[[160, 200]])

    def killed(*_args: object) -> None:
        raise RuntimeError("supervisor killed")

    monkeypatch.setattr(store, "clear_operator_request", killed)
    rec.tick()  # the action happens, the request stays
    assert len(cluster.submitted) == 2 and get_run(db, run_id).operator_request_json
    monkeypatch.undo()
    rec.tick()  # the action is found recorded: the request is cleared, nothing resubmitted
    run = get_run(db, run_id)
    assert len(cluster.submitted) == 2 and run.operator_request_json is None
    assert run.resume_step == 20 and run.skip_ranges_json == [[160, 200]]
    assert cluster.submitted[-1][1].exclude == ()


@pytest.mark.parametrize(("policy", "cancelled"), [("cancel", True), ("hold", False)])
def test_escalation_frees_the_job_unless_the_spec_holds_it(
    db: Database, tmp_path: Path, policy: str, cancelled: bool
) -> None:
    """recovery.on_escalation: by default an escalated run's job is cancelled (SLURM's TERM:
    the trainer checkpoints if it can), so a hung job does not keep its GPUs until walltime."""
    cluster, source = FakeCluster(), FakeSource()
    spec = {**TINY_SPEC, "recovery": {**TINY_SPEC.get("recovery", {}), "on_escalation": policy}}
    rec = make(db, tmp_path, cluster, source)
    run_id = new_run(db, spec)
    rec.tick()
    job = cluster.submitted[-1][0]
    cluster.set(job, JobState.RUNNING)
    rec.tick()
    ctx = ActContext(run_id=run_id, attempt=1, job_id=job, job_active=True)
    assert rec.actuator.apply(ctx, Remedy(RemedyKind.ESCALATE, "hang recurred"))
    assert get_run(db, run_id).state is RunState.NEEDS_ATTENTION
    assert cluster.cancelled == ([job] if cancelled else [])
    (action,) = [a for a in rows(db, Action, run_id) if a.kind == "escalate"]
    assert action.result_json == {"job": "cancelled" if cancelled else "held"}
