"""Two supervisors on one database: the lease on the database's clock, renewed during a
tick and held through a slow side effect, and the epoch that fences a deposed replica."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import select
from watchdog_fakes import TINY_SPEC, FakeCluster, FakeSource

from contracts.spec import RunSpec
from supervisor import store
from supervisor.db import Database
from supervisor.launcher import job_name
from supervisor.models import Action, Attempt, Lease
from supervisor.slurm import JobRequest
from supervisor.watchdog.lease import Deposed
from supervisor.watchdog.reconciler import Reconciler, WatchdogConfig

TTL_S = 1.0  # the heartbeat renews every TTL/3: room for a loaded machine's scheduling


@dataclass
class SlowSubmit(FakeCluster):
    """The first sbatch hangs until the test releases it (a slow controller)."""

    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def submit(self, request: JobRequest, fn):  # type: ignore[no-untyped-def]
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60)
        return super().submit(request, fn)


def replica(db: Database, tmp_path: Path, cluster: FakeCluster) -> Reconciler:
    """A supervisor with its own engine on the shared database, as on another host."""
    config = WatchdogConfig(home=tmp_path / "home", lease_ttl_s=TTL_S)
    return Reconciler(Database(db.url), cluster, FakeSource(), config, registry=CollectorRegistry())


def lease_expiry(db: Database) -> datetime:
    with db.session() as s:
        return s.scalar(select(Lease.expires_at))


def test_a_slow_submit_keeps_the_lease_and_makes_one_job(db: Database, tmp_path: Path) -> None:
    cluster = SlowSubmit()
    first, second = replica(db, tmp_path, cluster), replica(db, tmp_path, cluster)
    with db.write_session() as s:
        run_id = store.create_run(s, RunSpec.model_validate(TINY_SPEC))[0].id
    ticking = threading.Thread(target=first.tick)
    ticking.start()
    try:
        assert cluster.entered.wait(60)
        blocked_until = lease_expiry(db)
        # The second replica ticks on while the first one's sbatch outlives the lease's TTL
        # twice over (the heartbeat renewed it): it never acts meanwhile.
        paced = threading.Event()  # never set: paces the second replica's ticks
        while lease_expiry(db) < blocked_until + timedelta(seconds=2 * TTL_S):
            assert not second.tick().leader
            paced.wait(TTL_S / 4)
    finally:
        cluster.release.set()
        ticking.join(60)
    assert [j for j, r in cluster.submitted if r.job_name == job_name(run_id, 1)] == ["100"]
    assert not second.tick().leader and first.tick().leader
    with db.session() as s:
        (attempt,) = s.scalars(select(Attempt).where(Attempt.run_id == run_id)).all()
    assert attempt.job_id == "100" and len(cluster.submitted) == 1


def test_a_deposed_replica_neither_records_an_intent_nor_acts(db: Database, tmp_path: Path) -> None:
    cluster = FakeCluster()
    first, second = replica(db, tmp_path, cluster), replica(db, tmp_path, cluster)
    with db.write_session() as s:
        run_id = store.create_run(s, RunSpec.model_validate(TINY_SPEC))[0].id
    assert first.lease.acquire()
    with db.write_session() as s:  # the first replica stalls past its TTL
        s.execute(
            Lease.__table__.update().values(expires_at=datetime.now(UTC) - timedelta(hours=1))
        )
        s.commit()
    assert second.lease.acquire() and second.lease.epoch == first.lease.epoch + 1  # type: ignore[operator]
    with pytest.raises(Deposed):
        first.actuator.submit_attempt(run_id, 1, resume_step=None, reason="submit")
    with pytest.raises(Deposed):
        first.lease.renew()
    assert cluster.submitted == []
    with db.session() as s:
        assert s.scalars(select(Action).where(Action.run_id == run_id)).all() == []


def test_lease_expiry_is_the_databases_clock(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica whose host clock runs an hour fast must not see a live lease as expired."""
    ttl = timedelta(seconds=30)
    with db.write_session() as s:
        assert store.acquire_lease(s, "reconciler", "a", ttl) == 1
    fast = datetime.now(UTC) + timedelta(hours=1)
    for module in (store.runs, store.attempts, store.actions, store.tokens, store.endpoints):
        if hasattr(module, "utcnow"):  # every host-clock read of the store
            monkeypatch.setattr(module, "utcnow", lambda: fast)
    with db.write_session() as s:
        assert store.acquire_lease(s, "reconciler", "b", ttl) is None
    with db.write_session() as s:
        assert store.acquire_lease(s, "reconciler", "a", ttl) == 1  # renewal keeps the epoch
        assert store.renew_lease(s, "reconciler", "a", 1, ttl)
        assert not store.renew_lease(s, "reconciler", "a", 2, ttl)
        s.commit()
    with db.write_session() as s:
        assert store.acquire_lease(s, "reconciler", "b", -ttl) is None
        assert store.acquire_lease(s, "reconciler", "a", -ttl) == 1  # expired at once
    with db.write_session() as s:
        assert store.acquire_lease(s, "reconciler", "b", ttl) == 2  # changed hands
