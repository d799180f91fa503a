"""Webhook notifications through the outbox: delivered at least once (retried with backoff
until the webhook accepts, and sent by the next supervisor when one is killed right after an
escalation), with an idempotency id, and never blocking the caller."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, update
from watchdog_fakes import Hook

from supervisor.db import Database
from supervisor.models import OutboxMessage
from supervisor.watchdog import outbox
from supervisor.watchdog.notify import Notifier


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook(failures=2)
    yield h
    h.close()


def put(db: Database, notifier: Notifier, key: str, text: str, **fields: object) -> None:
    with db.write_session() as s:
        notifier.enqueue(s, key, text, **fields)
        s.commit()
    notifier.wake()


def messages(db: Database) -> list[OutboxMessage]:
    with db.session() as s:
        return list(s.scalars(select(OutboxMessage).order_by(OutboxMessage.id)))


def test_delivered_after_retries_with_slack_text(db: Database, hook: Hook) -> None:
    n = Notifier(hook.url, db, attempts=4, backoff_s=0.01)
    text = "[nightwatch] r1 NEEDS ATTENTION: restart storm"
    put(db, n, "r1|1|escalate|-", text, run_id="r1", remedy="escalate")
    assert n.flush(10)
    n.close()
    assert hook.posts == 3
    assert hook.received == [
        {"id": "r1|1|escalate|-", "text": text, "run_id": "r1", "remedy": "escalate"}
    ]
    (row,) = messages(db)
    assert row.delivered_at is not None and row.tries == 1
    assert n.delivered == 1 and n.failed_tries == 0


def test_kept_and_retried_with_backoff_until_delivered(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A webhook down for longer than the quick retries: the message waits in the outbox
    (nothing is dropped), each failure pushing its next try further out, until it lands. The
    sender's clock stands still an hour ahead, so the backoff is read exactly."""
    clock = datetime.now(UTC) + timedelta(hours=1)
    monkeypatch.setattr("supervisor.watchdog.notify.utcnow", lambda: clock)
    down = Hook(failures=5)
    try:
        n = Notifier(down.url, db, attempts=2, backoff_s=0.01)
        with db.write_session() as s:  # stored, not woken: the test drives the sender
            n.enqueue(s, "k1", "hello", run_id="r1")
            s.commit()
        waits = []
        for _ in range(2):  # two rounds of two quick tries each fail
            with db.write_session() as s:  # time passes: the message is due again
                s.execute(update(OutboxMessage).values(next_try_at=datetime.now(UTC)))
                s.commit()
            assert n.deliver_due() == 1
            (row,) = messages(db)
            assert row.delivered_at is None and row.last_error
            waits.append(row.next_try_at - clock)
        assert waits[1] == 2 * waits[0] > timedelta(0)  # backing off
        assert n.deliver_due() == 0  # not due yet
        with db.write_session() as s:
            s.execute(update(OutboxMessage).values(next_try_at=datetime.now(UTC)))
            s.commit()
        assert n.deliver_due() == 1
        (row,) = messages(db)
        assert row.delivered_at is not None and row.tries == 3
        assert down.received == [{"id": "k1", "text": "hello", "run_id": "r1"}]
        n.close()
    finally:
        down.close()


def test_never_blocks_the_caller(db: Database) -> None:
    slow = Hook(failures=100, hang=0.3)
    try:
        n = Notifier(slow.url, db, attempts=2, backoff_s=0.01, timeout_s=2)
        started = time.perf_counter()
        for i in range(20):
            put(db, n, f"k{i}", f"message {i}", run_id="r1")
        # Blocking would take ≥ 20 × 0.3 s; allow a loaded CI box its thread start-up.
        assert time.perf_counter() - started < 2.0
        n.close(timeout_s=0.1)
    finally:
        slow.close()


def test_disabled_without_url(db: Database) -> None:
    n = Notifier(None, db)
    assert not n.enabled
    put(db, n, "k1", "nothing")
    assert messages(db) == [] and n.flush(1)


def test_backoff_grows_to_its_cap() -> None:
    assert [outbox.backoff_s(t, 1.0) for t in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert outbox.backoff_s(30, 1.0) == outbox.MAX_BACKOFF_S
