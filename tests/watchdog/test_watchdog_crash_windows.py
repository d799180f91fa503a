"""Crash windows of the reconcile loop (issue 21, finding 7), each with the real reconciler,
store and actuator on SQLite and PostgreSQL, a fake SLURM that outlives the "killed"
supervisor (`Crash` stands for SIGKILL) and a fresh Reconciler as the restarted one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import select, update
from watchdog_curves import Faults, simulate
from watchdog_fakes import TINY_SPEC, Crash, FakeCluster, FakeSource, Hook

from contracts.spec import RunSpec
from supervisor import store
from supervisor.db import Database
from supervisor.launcher import job_name
from supervisor.models import Action, ActionState, Lease, Run, RunState
from supervisor.slurm import JobRequest, JobState, SourceUnavailable
from supervisor.watchdog.actions import ActContext, Actuator
from supervisor.watchdog.notify import Notifier
from supervisor.watchdog.reconciler import Reconciler, WatchdogConfig
from supervisor.watchdog.snapshot import Remedy, RemedyKind


def make(db: Database, tmp_path: Path, cluster: FakeCluster, source: FakeSource) -> Reconciler:
    """A supervisor process of its own (its own lease holder), as after a restart."""
    config = WatchdogConfig(home=tmp_path / "home", lease_ttl_s=60)
    return Reconciler(db, cluster, source, config, registry=CollectorRegistry())


def new_run(db: Database) -> str:
    with db.write_session() as s:
        run, _ = store.create_run(s, RunSpec.model_validate(TINY_SPEC))
        return run.id


def get_run(db: Database, run_id: str) -> Run:
    with db.session() as s:
        return store.get_run(s, run_id)


def cancel(db: Database, run_id: str) -> None:
    with db.write_session() as s:
        store.request_cancel(s, run_id)


def unfinished(db: Database, run_id: str) -> list[str]:
    with db.session() as s:
        rows = s.scalars(
            select(Action).where(Action.run_id == run_id, Action.state == ActionState.INTENT)
        )
        return [a.key for a in rows]


def live(cluster: FakeCluster, run_id: str) -> list[str]:
    return sorted(cluster.live_jobs(f"nw-{run_id}-"))


def restart(db: Database, tmp_path: Path, cluster: FakeCluster, source: FakeSource) -> Reconciler:
    """The killed supervisor's lease runs out; a new process takes over."""
    expire_lease(db)
    return make(db, tmp_path, cluster, source)


def expire_lease(db: Database) -> None:
    """What the passing of a lease's TTL does, without waiting for it."""
    with db.write_session() as s:
        s.execute(update(Lease).values(expires_at=datetime.now(UTC) - timedelta(hours=1)))
        s.commit()


class FailingSubmit(FakeCluster):
    """sbatch answers with an error (the submission is refused or times out)."""

    def submit(self, request: JobRequest, fn):  # type: ignore[no-untyped-def]
        raise SourceUnavailable("sbatch: error: Batch job submission failed")


def test_pending_run_cancelled_after_a_failed_first_submission_is_cancelled(
    db: Database, tmp_path: Path
) -> None:
    cluster, source = FailingSubmit(), FakeSource()
    rec = make(db, tmp_path, cluster, source)
    run_id = new_run(db)
    rec.tick()
    assert get_run(db, run_id).current_attempt == 1  # a failed attempt: no longer cancel-now
    cancel(db, run_id)
    rec.tick()
    run = get_run(db, run_id)
    assert run.state is RunState.CANCELLED, run.state
    assert unfinished(db, run_id) == []


def test_cut_off_first_submission_then_cancel_cancels_the_orphan_job(
    db: Database, tmp_path: Path
) -> None:
    """Killed after sbatch, before the job id was recorded; cancelled while it was down: the
    run reaches `cancelled` and the job found by its name is cancelled."""
    cluster, source = FakeCluster(crash_after_submit=True), FakeSource()
    run_id = new_run(db)
    with pytest.raises(Crash):
        make(db, tmp_path, cluster, source).tick()
    (orphan,) = live(cluster, run_id)
    cancel(db, run_id)
    rec = restart(db, tmp_path, cluster, source)
    rec.tick()
    assert get_run(db, run_id).state is RunState.CANCELLED
    assert cluster.cancelled == [orphan] and live(cluster, run_id) == []
    assert unfinished(db, run_id) == []
    rec.tick()
    assert cluster.cancelled == [orphan]  # nothing live is left to cancel


def test_cut_after_sbatch_during_a_remedy_and_cancelled_while_down(
    db: Database, tmp_path: Path
) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec = make(db, tmp_path, cluster, source)
    run_id = new_run(db)
    rec.tick()
    job1 = cluster.submitted[-1][0]
    cluster.set(job1, JobState.RUNNING)
    rec.tick()
    nan = Faults(nan_from=121)
    source.samples[(run_id, 1)] = simulate(1, steps=130, steps_per_sample=2, faults=nan)
    cluster.crash_after_submit = True
    with pytest.raises(Crash):
        rec.tick()  # the rollback's sbatch went through; its job id was never recorded
    job2 = cluster.submitted[-1][0]
    assert live(cluster, run_id) == [job2]
    cancel(db, run_id)
    again = restart(db, tmp_path, cluster, source)
    again.tick()
    assert get_run(db, run_id).state is RunState.CANCELLED
    assert live(cluster, run_id) == []
    assert cluster.cancelled == [job1, job2]
    assert unfinished(db, run_id) == []


def test_a_terminal_run_never_keeps_a_live_job(db: Database, tmp_path: Path) -> None:
    """Level-triggered: whatever left it behind, a job named for a finished run is cancelled,
    and the cancel is recorded as an action first."""
    cluster, source = FakeCluster(), FakeSource()
    rec = make(db, tmp_path, cluster, source)
    run_id = new_run(db)
    rec.tick()
    cancel(db, run_id)
    rec.tick()
    assert get_run(db, run_id).state is RunState.CANCELLED
    stray = cluster.submit(
        JobRequest(job_name=job_name(run_id, 1), log_dir=tmp_path, nodes=1, tasks_per_node=1),
        lambda: None,
    ).job_id
    rec.tick()
    assert stray in cluster.cancelled and live(cluster, run_id) == []
    with db.session() as s:
        keys = [a.key for a in s.scalars(select(Action).where(Action.run_id == run_id))]
    assert f"{run_id}|1|cancel|{stray}" in keys


def test_killed_during_an_escalation_the_webhook_is_still_sent(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the escalation committed, before its outcome: the next supervisor
    finishes it and the webhook gets the message, once, with its idempotency id."""
    hook = Hook()
    try:
        cluster, source = FakeCluster(), FakeSource()
        notifier = Notifier(hook.url, db)
        rec = Reconciler(
            db, cluster, source, WatchdogConfig(home=tmp_path / "home", lease_ttl_s=60),
            registry=CollectorRegistry(), notifier=notifier,
        )  # fmt: skip
        run_id = new_run(db)
        rec.tick()
        remedy = Remedy(RemedyKind.ESCALATE, "restart storm")
        with monkeypatch.context() as m:
            m.setattr(Actuator, "_finish", lambda *a, **k: (_ for _ in ()).throw(Crash()))
            m.setattr(Notifier, "wake", lambda self: None)  # the process dies before it posts
            with pytest.raises(Crash):
                rec.actuator.apply(ActContext(run_id, 1, "100", True), remedy)
        assert get_run(db, run_id).state is RunState.NEEDS_ATTENTION
        assert hook.received == []
        notifier.close()

        again = Notifier(hook.url, db)
        restarted = Reconciler(
            db, cluster, source, WatchdogConfig(home=tmp_path / "home", lease_ttl_s=60),
            registry=CollectorRegistry(), notifier=again,
        )  # fmt: skip
        expire_lease(db)
        restarted.tick()
        assert again.flush(10)
        again.close()
        key = f"{run_id}|1|escalate|{remedy.target}"
        assert hook.received == [
            {
                "id": key,
                "text": f"[nightwatch] {run_id} NEEDS ATTENTION: restart storm",
                "run_id": run_id,
                "attempt": 1,
                "remedy": "escalate",
            }
        ]
        assert unfinished(db, run_id) == []
    finally:
        hook.close()


def test_a_message_left_in_the_outbox_is_sent_by_the_next_leader(
    db: Database, tmp_path: Path
) -> None:
    """Killed after a remedy's outcome (and its message) committed, before the post."""
    hook = Hook()
    try:
        run_id = new_run(db)
        notifier = Notifier(hook.url, db)
        with db.write_session() as s:
            notifier.enqueue(s, f"{run_id}|1|restart|-", "[nightwatch] restarted", run_id=run_id)
            s.commit()
        rec = Reconciler(
            db, FakeCluster(), FakeSource(), WatchdogConfig(home=tmp_path / "home"),
            registry=CollectorRegistry(), notifier=notifier,
        )  # fmt: skip
        rec.tick()
        assert notifier.flush(10)
        notifier.close()
        assert [m["id"] for m in hook.received] == [f"{run_id}|1|restart|-"]
    finally:
        hook.close()
