"""Group commit of submissions: batched, and each request still gets its own outcome."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import func, select

from contracts.spec import RunSpec
from supervisor import store
from supervisor.api.submissions import SubmissionWriter
from supervisor.db import Database
from supervisor.models import Event, Run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_a_batch_of_submissions_keeps_each_outcome_apart(database: Database) -> None:
    """30 new runs, 10 concurrent retries of one key and a reuse of that key with another
    spec, all in flight at once: far fewer transactions than requests, one run per key,
    the conflict fails alone, and every stored run has its creation event."""
    spec = RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml")
    other = spec.model_copy(update={"name": "other"})
    writer = SubmissionWriter(database)

    async def main() -> list[object]:
        calls = [writer.submit(spec, created_by=None, idempotency_key=None) for _ in range(30)]
        calls += [writer.submit(spec, created_by="ci", idempotency_key="k") for _ in range(10)]
        calls.append(writer.submit(other, created_by="ci", idempotency_key="k"))
        return await asyncio.gather(*calls, return_exceptions=True)

    try:
        outcomes = asyncio.run(main())
    finally:
        writer.close()
    fresh, retries, conflict = outcomes[:30], outcomes[30:40], outcomes[40]
    assert all(created for _, created in fresh)  # type: ignore[misc]
    assert len({run.id for run, _ in fresh}) == 30  # type: ignore[misc]
    assert len({run.id for run, _ in retries}) == 1  # type: ignore[misc]
    assert sum(created for _, created in retries) == 1  # type: ignore[misc]
    assert isinstance(conflict, store.IdempotencyConflict)
    assert writer.batches < 41
    with database.session() as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 31
        assert s.scalar(select(func.count()).select_from(Event)) == 31


def test_requests_whose_insert_fails_get_the_error(tmp_path: Path) -> None:
    """Nothing is reported stored that was not: on a database without the tables every
    insert fails, and each waiting request gets its error rather than a run."""
    spec = RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml")
    writer = SubmissionWriter(Database(f"sqlite:///{tmp_path / 'empty.db'}"))

    async def main() -> list[object]:
        calls = [writer.submit(spec, created_by=None, idempotency_key=None) for _ in range(3)]
        return await asyncio.gather(*calls, return_exceptions=True)

    try:
        outcomes = asyncio.run(main())
    finally:
        writer.close()
    assert all(isinstance(o, Exception) for o in outcomes), outcomes
    with pytest.raises(Exception, match="no such table"):
        raise outcomes[0]  # type: ignore[misc]


@pytest.mark.timeout(60)  # the bug it guards against hung every later request
def test_a_request_cancelled_while_queued_is_dropped_and_the_writer_goes_on(
    tmp_path: Path,
) -> None:
    """A client that goes away while its submission waits (here: behind another process's
    write lock) cancels it; the writer skips it and serves the next ones."""
    from sqlalchemy import text

    url = f"sqlite:///{tmp_path / 'nightwatch.db'}"
    db, other = Database(url), Database(url)
    db.upgrade()
    spec = RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml")
    writer = SubmissionWriter(db)
    blocker = other.write_session()
    blocker.execute(text("SELECT 1"))  # BEGIN IMMEDIATE: holds the write lock

    async def main() -> tuple[object, object, object]:
        first = asyncio.create_task(writer.submit(spec, created_by=None, idempotency_key="a"))
        await asyncio.sleep(0.3)  # taken into a batch, waiting for the lock
        gone = asyncio.create_task(writer.submit(spec, created_by=None, idempotency_key="b"))
        last = asyncio.create_task(writer.submit(spec, created_by=None, idempotency_key="c"))
        await asyncio.sleep(0.1)
        gone.cancel()
        blocker.rollback()
        return await asyncio.gather(first, gone, last, return_exceptions=True)

    try:
        first, gone, last = asyncio.run(main())
    finally:
        blocker.close()
        writer.close()
    assert isinstance(gone, asyncio.CancelledError)
    assert first[1] and last[1]  # type: ignore[index]
    with db.session() as s:
        keys = set(s.scalars(select(Run.idempotency_key)))
    assert keys == {"a", "c"}
    other.dispose()
    db.dispose()
