"""The notification outbox: webhook messages stored in the transaction that decided them.

At least once: a message is a row from the moment its escalation (or remedy, or completion)
commits, whatever happens to the process after; the sender (supervisor.watchdog.notify) posts
due rows and marks them delivered only once the webhook accepted them. A crash between the
post and the mark sends it again, so every payload carries `id`, the idempotency id receivers
drop duplicates by. A row being posted is claimed by pushing its `next_try_at` past the post's
timeout, so two senders (replicas) do not post it at the same moment.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from supervisor.models import OutboxMessage, utcnow

#: Longest wait between two tries of one message; it is retried until delivered.
MAX_BACKOFF_S = 300.0


def enqueue(session: Session, key: str, text: str, **fields: Any) -> None:
    """Add a message to the caller's transaction (the caller commits, with what it decided)."""
    payload = {"id": key, "text": text, **fields}
    session.add(OutboxMessage(key=key, run_id=fields.get("run_id"), payload_json=payload))


def backoff_s(tries: int, base_s: float) -> float:
    """Seconds before try `tries + 1` of a message that failed `tries` times (pure)."""
    return min(MAX_BACKOFF_S, base_s * 2 ** max(0, tries - 1))


def claim_due(session: Session, limit: int, hold: timedelta) -> Sequence[OutboxMessage]:
    """Undelivered messages due now, each held for `hold` (the post's timeout) and committed."""
    now = utcnow()
    due = session.scalars(
        select(OutboxMessage)
        .where(OutboxMessage.delivered_at.is_(None), OutboxMessage.next_try_at <= now)
        .order_by(OutboxMessage.id)
        .limit(limit)
    ).all()
    claimed = []
    for message in due:
        held = session.execute(
            update(OutboxMessage)
            .where(OutboxMessage.id == message.id, OutboxMessage.next_try_at == message.next_try_at)
            .values(next_try_at=now + hold)
        ).rowcount
        if held:
            claimed.append(message)
    session.commit()
    return claimed


def mark_delivered(session: Session, message_id: int) -> None:
    session.execute(
        update(OutboxMessage)
        .where(OutboxMessage.id == message_id)
        .values(delivered_at=utcnow(), tries=OutboxMessage.tries + 1, last_error=None)
    )
    session.commit()


def mark_failed(session: Session, message_id: int, error: str, retry_at: datetime) -> None:
    session.execute(
        update(OutboxMessage)
        .where(OutboxMessage.id == message_id)
        .values(tries=OutboxMessage.tries + 1, last_error=error[:1000], next_try_at=retry_at)
    )
    session.commit()


def undelivered(session: Session) -> int:
    pending = select(OutboxMessage.id).where(OutboxMessage.delivered_at.is_(None))
    return len(session.scalars(pending).all())
