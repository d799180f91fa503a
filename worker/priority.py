"""CPU priority of a node task that runs no ranks yet (a spare, a standby job's node).

Such a node task imports the training program so that it can fork ranks at once when an order
comes, and until then nothing waits for it: it imports at the lowest priority (nice 19), so
that where it shares CPUs with training (the dev cluster's nodes on one host; a successor's
node beside a job still saving) it takes only the time training leaves idle. It goes back to
its own priority after the import, so ranks it forks later run at the priority it was started
with; where it could not go back (no CAP_SYS_NICE, an RLIMIT_NICE that does not allow it) it
imports at its own priority instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("nightwatch.worker")

LOWEST_PRIORITY = 19
#: CAP_SYS_NICE's bit in /proc/<pid>/status `CapEff` (linux/capability.h).
CAP_SYS_NICE = 23


def may_raise_priority_to(nice: int) -> bool:
    """Whether this process may lower its nice value back to `nice` (root's capability, or an
    RLIMIT_NICE whose floor `20 - limit` is at most `nice`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - soft <= nice:
        return True
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    caps = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("CapEff:")), "0")
    return bool(int(caps, 16) >> CAP_SYS_NICE & 1)


@contextlib.contextmanager
def lowest_priority(enabled: bool, context: dict[str, object]) -> Iterator[None]:
    """Run the body at nice 19 when `enabled` and the priority can be restored afterwards."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    if not enabled or own >= LOWEST_PRIORITY or not may_raise_priority_to(own):
        yield
        return
    os.setpriority(os.PRIO_PROCESS, 0, LOWEST_PRIORITY)
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, own)
        except PermissionError:
            log.warning("could not return to nice %d after the import", own, extra=context)
