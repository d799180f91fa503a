"""Worker metrics endpoints registered per attempt and node."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from supervisor.models import (
    ACTIVE_RUN_STATES,
    Endpoint,
    Run,
    utcnow,
)
from supervisor.store.runs import get_run


def register_endpoint(
    session: Session, run_id: str, attempt: int, node: str, host: str, port: int
) -> None:
    """Insert or refresh a worker's metrics endpoint; every call is also a heartbeat."""
    get_run(session, run_id)
    now = utcnow()
    values = {"host": host, "port": port, "last_seen": now}
    where = (Endpoint.run_id == run_id, Endpoint.attempt == attempt, Endpoint.node == node)
    if session.execute(update(Endpoint).where(*where).values(**values)).rowcount:
        session.commit()
        return
    session.add(Endpoint(run_id=run_id, attempt=attempt, node=node, **values))
    try:
        session.commit()
    except IntegrityError:  # a concurrent heartbeat inserted it first
        session.rollback()
        session.execute(update(Endpoint).where(*where).values(**values))
        session.commit()


def active_endpoints(session: Session) -> Sequence[Endpoint]:
    """Endpoints of the current attempt of every active run (Prometheus HTTP-SD targets)."""
    return session.scalars(
        select(Endpoint)
        .join(Run, Run.id == Endpoint.run_id)
        .where(Run.state.in_(ACTIVE_RUN_STATES), Endpoint.attempt == Run.current_attempt)
        .order_by(Endpoint.run_id, Endpoint.node)
    ).all()
