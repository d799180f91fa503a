"""The reconciler's lease: who may act, and the fence every side effect passes.

One replica acts at a time: the holder of the `leases` row, expiring on the database's clock
(replicas' own clocks may disagree). Holding it is checked where it matters, not once a tick:
- the tick renews it before each run, and the actuator before each side effect, in the same
  transaction that records the side effect's intent (the fence: `Deposed` when the epoch, bumped
  each time the lease changes hands, is no longer ours);
- while a side effect is in flight (an sbatch may take seconds), a heartbeat keeps renewing
  it, so a slow call never lets a second replica resume the same intent beside it. A replica
  that dies stops renewing, and its successor takes over one TTL later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from sqlalchemy.orm import Session

from supervisor import store
from supervisor.db import Database

log = logging.getLogger("nightwatch.watchdog.lease")


class Deposed(Exception):
    """This replica's lease changed hands: it must not act until it holds the lease again."""


class LeaseGuard:
    def __init__(self, db: Database, name: str, holder: str, ttl_s: float) -> None:
        self.db = db
        self.name = name
        self.holder = holder
        self.ttl = timedelta(seconds=ttl_s)
        self.epoch: int | None = None
        self._renewed = -float("inf")  # monotonic time of the last renewal: when to renew next

    def acquire(self) -> bool:
        """Take or renew the lease at the start of a tick; True while this replica holds it."""
        with self.db.write_session() as s:
            self.epoch = store.acquire_lease(s, self.name, self.holder, self.ttl)
        self._renewed = time.monotonic()
        return self.epoch is not None

    def keep(self) -> None:
        """Renew once a third of the TTL has passed since the last renewal (a long tick keeps
        the lease without a write per run); `Deposed` when it changed hands. This host's clock
        only schedules renewals: expiry is the database's."""
        if time.monotonic() - self._renewed >= self.ttl.total_seconds() / 3:
            self.renew()

    def fence(self, session: Session) -> None:
        """Renew the lease in the caller's transaction, or raise `Deposed`."""
        if self.epoch is None or not store.renew_lease(
            session, self.name, self.holder, self.epoch, self.ttl
        ):
            session.rollback()
            lost, self.epoch = self.epoch, None
            raise Deposed(f"lease {self.name} epoch {lost} is no longer {self.holder}'s")
        self._renewed = time.monotonic()

    def renew(self) -> None:
        """Renew the lease now, or raise `Deposed`."""
        with self.db.write_session() as s:
            self.fence(s)
            s.commit()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Fence one side effect and keep the lease renewed until it returns."""
        self.renew()
        stop = threading.Event()
        args = (stop, self.epoch)
        beat = threading.Thread(target=self._heartbeat, args=args, daemon=True)
        beat.start()
        try:
            yield
        finally:
            stop.set()
            beat.join()

    def _heartbeat(self, stop: threading.Event, epoch: int) -> None:
        while not stop.wait(self.ttl.total_seconds() / 3):
            try:
                with self.db.write_session() as s:
                    if not store.renew_lease(s, self.name, self.holder, epoch, self.ttl):
                        return  # lost anyway: the next fence says so
                    s.commit()
            except Exception:  # a failed renewal is retried; the fence decides
                log.exception("lease heartbeat failed")
