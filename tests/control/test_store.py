"""The data-access module on SQLite and PostgreSQL: idempotency, compare-and-set state changes,
replay-safe actions, leases, endpoints, and migrations that match the models."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, select

from contracts.spec import RunSpec
from supervisor import store
from supervisor.auth import Scope
from supervisor.db import Database
from supervisor.models import Base, EventKind, RunState, Token

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def spec() -> RunSpec:
    return RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml")


def test_migrations_create_exactly_the_models(database: Database) -> None:
    with database.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    database.upgrade()  # idempotent


def test_owner_migration_keeps_every_row_and_backfills_owners(
    database: Database, spec: RunSpec
) -> None:
    """0002 rebuilds `runs` on SQLite: that must not cascade-delete its children, and existing
    runs belong to their token's owner (or to no one)."""
    from sqlalchemy import text

    from supervisor.db import upgrade

    with database.engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
    _downgrade(database, "0001")
    now = "2026-11-27 00:00:00+00:00"
    run = "INSERT INTO runs VALUES (:id, 'n', '{}', 'running', NULL, false, :key, 'h', :by, "
    run += f"'{now}', '{now}', 1, '[]', '[]', 10, NULL, NULL)"
    with database.engine.begin() as conn:
        conn.execute(
            text(f"INSERT INTO tokens VALUES ('t-1', 'ci', '[]', 'h1', NULL, '{now}', false)")
        )
        conn.execute(text(run), {"id": "r-1", "key": "k", "by": "t-1"})
        conn.execute(text(run), {"id": "r-2", "key": None, "by": None})
        conn.execute(
            text("INSERT INTO attempts (run_id, number, executor, nodes_json, state, "
                 f"submitted_at, skip_ranges_json, exclude_json) VALUES ('r-1', 1, 'local', "
                 f"'[]', 'running', '{now}', '[]', '[]')")
        )  # fmt: skip
    upgrade(database.engine)
    with database.session() as s:
        assert [(r.id, r.owner) for r in store.list_runs(s).items] == [("r-2", ""), ("r-1", "ci")]
        assert len(store.get_attempts(s, "r-1")) == 1
        assert [t.owner for t in store.list_tokens(s)] == ["ci"]
    with database.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        if database.is_sqlite:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def _downgrade(database: Database, revision: str) -> None:
    from alembic import command
    from alembic.config import Config

    from supervisor.db import MIGRATIONS_DIR

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    with database.engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


def test_same_key_same_spec_is_one_run_other_spec_conflicts(
    database: Database, spec: RunSpec
) -> None:
    with database.write_session() as s:
        first, created = store.create_run(s, spec, idempotency_key="k")
        again, created_again = store.create_run(s, spec, idempotency_key="k")
        assert created and not created_again and again.id == first.id
        other = spec.model_copy(update={"name": "other"})
        with pytest.raises(store.IdempotencyConflict, match=first.id):
            store.create_run(s, other, idempotency_key="k")
        assert store.list_runs(s).total == 1


def test_idempotency_keys_are_per_owner_within_a_batch_and_after_it(
    database: Database, spec: RunSpec
) -> None:
    other = spec.model_copy(update={"name": "other"})
    with database.write_session() as s:
        first = store.add_runs(
            s, [store.NewRun(spec, "t-a", "k", "a"), store.NewRun(spec, "t-b", "k", "b")]
        )
        s.commit()
        (a, a_created), (b, b_created) = first  # type: ignore[misc]
        assert a_created and b_created and a["id"] != b["id"]
        again = store.add_runs(
            s, [store.NewRun(other, "t-b", "k", "b"), store.NewRun(spec, "t-a2", "k", "a")]
        )
        s.commit()
    conflict, (replay, replay_created) = again  # type: ignore[misc]
    assert isinstance(conflict, store.IdempotencyConflict)
    assert b["id"] in str(conflict) and a["id"] not in str(conflict)
    assert replay["id"] == a["id"] and not replay_created


def test_a_batch_answers_each_request_like_a_request_of_its_own(
    database: Database, spec: RunSpec
) -> None:
    """The submission writer's batch: new runs, a retry of an earlier run, a retry and a
    conflict inside the batch, and a request without a key, in one transaction."""
    other = spec.model_copy(update={"name": "other"})
    with database.write_session() as s:
        earlier, _ = store.create_run(s, spec, idempotency_key="old")
        batch = [
            store.NewRun(spec, "t-1", "new"),
            store.NewRun(spec, "t-1", "old"),  # retry of the earlier run
            store.NewRun(spec, "t-1", "new"),  # retry of the first item
            store.NewRun(other, "t-1", "new"),  # the first item's key, another spec
            store.NewRun(other, None, None),
            store.NewRun(other, "t-1", "old"),  # the earlier run's key, another spec
        ]
        outcomes = store.add_runs(s, batch)
        s.commit()

        (new, new_created), (old, old_created), (new_again, again_created) = outcomes[:3]
        assert new_created and not old_created and not again_created
        assert old["id"] == earlier.id and new_again["id"] == new["id"] != earlier.id
        assert isinstance(outcomes[3], store.IdempotencyConflict) and new["id"] in str(outcomes[3])
        keyless, keyless_created = outcomes[4]
        assert keyless_created and keyless["name"] == "other" and keyless["created_by"] is None
        assert isinstance(outcomes[5], store.IdempotencyConflict) and earlier.id in str(outcomes[5])

        assert store.list_runs(s).total == 3
        stored = store.get_run(s, new["id"])
        assert (stored.state, stored.created_by, stored.idempotency_key) == (
            RunState.PENDING, "t-1", "new"
        )  # fmt: skip
        assert stored.created_at == new["created_at"]
        assert [e.message for e in store.list_events(s, keyless["id"])] == ["run created (pending)"]


def test_state_changes_are_compare_and_set_and_leave_events(
    database: Database, spec: RunSpec
) -> None:
    with database.write_session() as s:
        run, _ = store.create_run(s, spec)
        assert store.transition_run(s, run.id, RunState.SUBMITTED, expected=[RunState.PENDING])
        # a stale writer that still believes the run is pending loses
        assert not store.transition_run(s, run.id, RunState.CANCELLED, expected=[RunState.PENDING])
        # an illegal transition is refused whatever `expected` says
        assert not store.transition_run(s, run.id, RunState.PENDING)
        assert store.transition_run(s, run.id, RunState.RUNNING, reason="first step seen")
        events = store.list_events(s, run.id)
        assert [e.message for e in events] == [
            "run created (pending)",
            "pending → submitted",
            "submitted → running: first step seen",
        ]
        assert events[-1].data_json == {"from": "submitted", "to": "running"}
        assert store.get_run(s, run.id).state == RunState.RUNNING


def test_cancel_is_immediate_only_before_the_first_attempt(
    database: Database, spec: RunSpec
) -> None:
    with database.write_session() as s:
        pending, _ = store.create_run(s, spec)
        assert store.request_cancel(s, pending.id).state == RunState.CANCELLED
        assert store.request_cancel(s, pending.id).state == RunState.CANCELLED  # idempotent

        live, _ = store.create_run(s, spec)
        store.create_attempt(s, live.id, executor="local", job_id="123")
        store.transition_run(s, live.id, RunState.SUBMITTED)
        run = store.request_cancel(s, live.id)
        assert run.state == RunState.SUBMITTED and run.cancel_requested
        store.transition_run(s, live.id, RunState.SUCCEEDED)
        with pytest.raises(store.Conflict, match="already succeeded"):
            store.request_cancel(s, live.id)


def test_attempts_number_up_and_snapshot_skips_and_excludes(
    database: Database, spec: RunSpec
) -> None:
    with database.write_session() as s:
        run, _ = store.create_run(s, spec)
        store.update_run(s, run.id, skip_ranges_json=[[64, 96]], excluded_nodes_json=["n2"])
        store.create_attempt(s, run.id, executor="slurm", job_id="41")
        second = store.create_attempt(s, run.id, executor="slurm", job_id="42", resume_step=40)
        assert second.number == 2 and second.skip_ranges_json == [[64, 96]]
        assert second.exclude_json == ["n2"]
        assert store.get_run(s, run.id).current_attempt == 2
        store.update_attempt(s, run.id, 2, nodes_json=["n1"], exit_code=0)
        assert [a.job_id for a in store.get_attempts(s, run.id)] == ["41", "42"]
        with pytest.raises(store.NotFound):
            store.update_attempt(s, run.id, 3, exit_code=1)


def test_an_action_runs_once_even_when_replayed(database: Database, spec: RunSpec) -> None:
    with database.write_session() as s:
        run, _ = store.create_run(s, spec)
        evidence = {"loss": 9.5, "median": 3.1}
        action = store.begin_action(s, run.id, 1, "rollback", "step-40", evidence)
        assert action is not None
        assert store.begin_action(s, run.id, 1, "rollback", "step-40", evidence) is None
        store.finish_action(s, action.key, ok=True, result={"job_id": "43"})
        incident = store.open_incident(s, run.id, 1, "loss_spike", evidence=evidence)
        store.update_incident(s, incident.id, remedy="rollback", steps_lost=12)
        kinds = [e.kind for e in store.list_events(s, run.id)]
        assert kinds.count(EventKind.ACTION_INTENT) == 1
        assert EventKind.ACTION_OUTCOME in kinds and EventKind.INCIDENT in kinds


def test_lease_has_one_holder_until_it_expires(database: Database) -> None:
    with database.write_session() as s:
        assert store.acquire_lease(s, "reconciler", "a", timedelta(seconds=30))
        assert not store.acquire_lease(s, "reconciler", "b", timedelta(seconds=30))
        assert store.acquire_lease(s, "reconciler", "a", timedelta(seconds=-1))  # renew, expired
        assert store.acquire_lease(s, "reconciler", "b", timedelta(seconds=30))


def test_endpoints_of_the_current_attempt_of_active_runs_are_targets(
    database: Database, spec: RunSpec
) -> None:
    with database.write_session() as s:
        run, _ = store.create_run(s, spec)
        store.create_attempt(s, run.id, executor="local")
        store.register_endpoint(s, run.id, 1, "n1", "127.0.0.1", 9001)
        assert store.active_endpoints(s) == []  # still pending: not scraped
        store.transition_run(s, run.id, RunState.SUBMITTED)
        store.register_endpoint(s, run.id, 1, "n1", "127.0.0.1", 9002)  # heartbeat, new port
        (endpoint,) = store.active_endpoints(s)
        assert (endpoint.node, endpoint.port) == ("n1", 9002)
        store.create_attempt(s, run.id, executor="local")
        assert store.active_endpoints(s) == []  # old attempt's endpoint is dropped


def test_evidence_with_nan_inf_and_datetimes_is_stored(database: Database, spec: RunSpec) -> None:
    """A NaN loss is exactly the evidence the watchdog records; PostgreSQL's json type rejects
    bare NaN tokens, so non-finite floats are stored as strings."""
    from datetime import UTC, datetime

    seen = datetime(2026, 11, 26, 3, 0, tzinfo=UTC)
    with database.write_session() as s:
        run, _ = store.create_run(s, spec)
        store.open_incident(
            s, run.id, 1, "nonfinite", evidence={"loss": float("nan"), "grad": [float("inf")],
                                                 "seen": seen},
        )  # fmt: skip
        (event,) = [e for e in store.list_events(s, run.id) if e.kind == EventKind.INCIDENT]
        assert event.data_json["loss"] == "nan" and event.data_json["grad"] == ["inf"]
        assert event.data_json["seen"] == str(seen)


def test_sqlite_write_lock_is_shared_by_threads_and_freed_on_every_path(tmp_path: Path) -> None:
    """16 threads writing at once all land (they queue on the engine's write lock, not on
    SQLite's sleeping busy handler); a write session that fails or is closed without commit
    frees the lock."""
    db = Database(f"sqlite:///{tmp_path / 'w.db'}")
    db.upgrade()

    def write(i: int) -> None:
        for j in range(20):
            with db.write_session() as s:
                store.create_token(s, f"t{i}-{j}", [Scope.READ])
                s.commit()

    threads = [threading.Thread(target=write, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    count = select(func.count()).select_from(Token)
    with pytest.raises(RuntimeError), db.write_session() as s:
        s.execute(count)  # BEGIN IMMEDIATE: holds the write lock
        raise RuntimeError
    abandoned = db.write_session()
    abandoned.execute(count)
    abandoned.close()
    t0 = time.perf_counter()
    with db.write_session() as s:  # would wait out the 30 s timeout if the lock had leaked
        assert s.scalar(count) == 16 * 20
    assert time.perf_counter() - t0 < 5
    db.dispose()


def test_sqlite_acknowledged_writes_are_durable_by_default(tmp_path: Path) -> None:
    """synchronous=FULL on every connection (in WAL, each commit syncs the log), unless the
    operator trades durability for speed (NIGHTWATCH_SQLITE_SYNCHRONOUS=normal)."""
    from supervisor.settings import Settings

    url = f"sqlite:///{tmp_path / 'nightwatch.db'}"
    assert Settings().sqlite_synchronous == "full"
    assert Settings.from_env({"NIGHTWATCH_SQLITE_SYNCHRONOUS": "normal"}).sqlite_synchronous == (
        "normal"
    )
    for level, expected in ((None, 2), ("normal", 1), ("full", 2)):  # PRAGMA's numbers
        db = Database(url) if level is None else Database(url, sqlite_synchronous=level)
        sessions = [db.session(), db.write_session(), db.request_read_session()]
        try:
            for session in sessions:
                conn = session.connection()
                assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == expected
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        finally:
            for session in sessions:
                session.close()
            db.dispose()
    with pytest.raises(ValueError, match="full or normal"):
        Database(url, sqlite_synchronous="off")
