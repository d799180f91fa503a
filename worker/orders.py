"""A node task's watch on its job's restart orders (`contracts.restart`).

Why polling a file: the node task already wakes every `REAP_INTERVAL_S` to reap its ranks, and
one `stat` there costs microseconds; the order is parsed only when the file changed.
"""

from __future__ import annotations

import time
from pathlib import Path

from contracts.restart import ORDER_NAME, RestartOrder, read_order
from worker.ranks import REAP_INTERVAL_S


class OrderWatch:
    """Notices an order for a later attempt than the one the node runs."""

    def __init__(self, control_dir: Path, attempt: int) -> None:
        self.control_dir = control_dir
        self.attempt = attempt
        self.order: RestartOrder | None = None
        self._stamp: tuple[int, int, int] | None = None

    def newer(self) -> bool:
        """True once an order for a later attempt is there (then kept in `order`)."""
        try:
            st = (self.control_dir / ORDER_NAME).stat()
        except OSError:
            return False
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return self.order is not None
        self._stamp = stamp
        order = read_order(self.control_dir)
        if order is not None and order.attempt > self.attempt:
            self.order = order
        return self.order is not None

    def wait(self, timeout_s: float) -> RestartOrder | None:
        """The next order, or None when none came within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.newer():
            if time.monotonic() >= deadline:
                return None
            time.sleep(REAP_INTERVAL_S)
        return self.order
