"""Worker tokens end with their run, through the real reconciler (SQLite and PostgreSQL): the
token the reconciler minted for each attempt stops resolving once the run is terminal."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from test_watchdog_reconciler import get_run, new_run, running
from watchdog_fakes import TINY_SPEC, FakeCluster, FakeSource, write_checkpoint

from contracts.paths import checkpoint_dir
from contracts.spec import RunSpec
from supervisor import store
from supervisor.db import Database
from supervisor.models import RunState, Token
from supervisor.slurm import JobState


def worker_tokens(db: Database, run_id: str) -> list[Token]:
    with db.session() as s:
        return list(s.scalars(select(Token).where(Token.run_id == run_id)))


def test_the_reconciler_revokes_a_runs_worker_tokens_when_it_ends(
    db: Database, tmp_path: Path
) -> None:
    cluster, source = FakeCluster(), FakeSource()
    rec, cancelled, _ = running(db, tmp_path, cluster, source)
    finished = new_run(db)
    rec.tick()
    job = cluster.submitted[-1][0]
    cluster.set(job, JobState.RUNNING)
    rec.tick()
    assert [t.revoked for t in worker_tokens(db, cancelled)] == [False]
    with db.write_session() as s:
        store.request_cancel(s, cancelled)
    rec.tick()
    assert get_run(db, cancelled).state is RunState.CANCELLED
    assert [t.revoked for t in worker_tokens(db, cancelled)] == [True]
    assert [t.revoked for t in worker_tokens(db, finished)] == [False]  # still running
    ckpt = checkpoint_dir(tmp_path / "home", finished, RunSpec.model_validate(TINY_SPEC))
    write_checkpoint(ckpt, 300, 2400)
    cluster.set(job, JobState.COMPLETED, exit_code=0)
    rec.tick()
    assert get_run(db, finished).state is RunState.SUCCEEDED
    assert [t.revoked for t in worker_tokens(db, finished)] == [True]
