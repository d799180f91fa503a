"""The reconciler's lease, timed by the database's clock."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import ColumnElement, case, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from supervisor.models import (
    Lease,
)


def db_now(session: Session) -> ColumnElement[Any]:
    """The database's clock, so replicas on hosts whose clocks differ agree on expiry.

    PostgreSQL: now() (the transaction's start). SQLite: CURRENT_TIMESTAMP to the
    millisecond (the plain keyword has whole seconds), in the text form SQLAlchemy stores
    datetimes in, so the two compare as strings."""
    if session.get_bind().dialect.name == "sqlite":
        return func.strftime("%Y-%m-%d %H:%M:%f", "now")
    return func.now()


def _db_later(session: Session, delta: timedelta) -> ColumnElement[Any]:
    if session.get_bind().dialect.name == "sqlite":
        return func.strftime("%Y-%m-%d %H:%M:%f", "now", f"{delta.total_seconds():+.3f} seconds")
    return func.now() + delta


def acquire_lease(session: Session, name: str, holder: str, ttl: timedelta) -> int | None:
    """Take or renew the named lease until the database's now + ttl; its epoch when `holder`
    holds it, else None. The epoch grows whenever the lease changes hands."""
    taken = session.execute(
        update(Lease)
        .where(Lease.name == name, (Lease.holder == holder) | (Lease.expires_at < db_now(session)))
        .values(
            holder=holder,
            expires_at=_db_later(session, ttl),
            epoch=case((Lease.holder == holder, Lease.epoch), else_=Lease.epoch + 1),
        )
    ).rowcount
    if taken:
        epoch = session.scalar(select(Lease.epoch).where(Lease.name == name))
        session.commit()
        return epoch
    if session.get(Lease, name) is not None:
        session.rollback()
        return None
    session.execute(
        insert(Lease).values(name=name, holder=holder, epoch=1, expires_at=_db_later(session, ttl))
    )
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        return None
    return 1


def renew_lease(session: Session, name: str, holder: str, epoch: int, ttl: timedelta) -> bool:
    """Extend the lease in the caller's transaction (no commit) if `holder` still holds it at
    `epoch`; False when it changed hands. The row stays locked until the caller commits, so
    a side effect's intent recorded in that transaction cannot race a new holder."""
    renewed = session.execute(
        update(Lease)
        .where(Lease.name == name, Lease.holder == holder, Lease.epoch == epoch)
        .values(expires_at=_db_later(session, ttl))
    ).rowcount
    return renewed == 1
