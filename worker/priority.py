"""CPU priority of a node task that runs no ranks yet (a spare, a standby job's node).

Such a node task imports the training program so that it can fork ranks at once when an order
comes, and until then nothing waits for it: it imports at the lowest priority (nice 19), so
that where it shares CPUs with training (the dev cluster's nodes on one host; a successor's
node beside a job still saving) it takes only the time training leaves idle. It goes back to
its own priority after the import, so ranks it forks later run at the priority it was started
with; where it could not go back (no CAP_SYS_NICE, an RLIMIT_NICE that does not allow it) it
imports at its own priority instead. With the kernel's autogroups (`sched_autogroup_enabled`)
a nice value weighs only against the same session's threads, and each node's step on a host
(its slurmstepd and the task under it) is a session of its own: a node task whose session
holds only it and its ancestors (which wait on it) sets its autogroup's nice value too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("nightwatch.worker")

LOWEST_PRIORITY = 19
#: How a node task's log line says it starts importing last (the soak's analysis finds it).
IMPORTING_LAST = "importing at nice"
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


#: How often a node importing at the lowest priority looks whether it is needed now.
NEEDED_POLL_S = 0.05


@contextlib.contextmanager
def lowest_priority(
    enabled: bool, context: dict[str, object], needed: Callable[[], bool] | None = None
) -> Iterator[None]:
    """Run the body at nice 19 when `enabled` and the priority can be restored afterwards;
    back at once when `needed()` turns true (an order that runs ranks here came: the import
    is then in the way of the restart, not of the training)."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    if not enabled or own >= LOWEST_PRIORITY or not may_raise_priority_to(own):
        yield
        return
    if needed is not None and needed():
        # Already ordered (a successor whose requeue came before its node tasks started): at
        # nice 19 the watch below would itself wait for CPU to see it, seconds on a busy host.
        log.info("needed at once: importing at nice %d", own, extra=context)
        yield
        return
    lowered = _Lowered(own, _own_autogroup_nice(), threading.get_native_id(), context)
    log.info("%s %d%s", IMPORTING_LAST, LOWEST_PRIORITY, " (and its autogroup)" if
             lowered.group is not None else "", extra=context)  # fmt: skip
    done = threading.Event()
    if needed is not None:

        def watch() -> None:
            while not done.wait(NEEDED_POLL_S):
                if needed():
                    log.info("needed now: back to nice %d", own, extra=context)
                    lowered.restore()
                    return

        threading.Thread(target=watch, name="nw-priority", daemon=True).start()
    try:
        yield
    finally:
        done.set()
        lowered.restore()


class _Lowered:
    """One thread (and its autogroup) at nice 19 until `restore` (once, from any thread)."""

    def __init__(self, own: int, group: int | None, tid: int, context: dict[str, object]):
        self.own, self.group, self.tid, self.context = own, group, tid, context
        self._lock = threading.Lock()
        self._restored = False
        os.setpriority(os.PRIO_PROCESS, tid, LOWEST_PRIORITY)
        if group is not None:
            _set_autogroup_nice(LOWEST_PRIORITY)

    def restore(self) -> None:
        with self._lock:
            if self._restored:
                return
            self._restored = True
            try:
                os.setpriority(os.PRIO_PROCESS, self.tid, self.own)
                if self.group is not None:
                    _set_autogroup_nice(self.group)
            except OSError:
                log.warning("could not return to nice %d after the import", self.own,
                            extra=self.context)  # fmt: skip


AUTOGROUP = Path("/proc/self/autogroup")


def _own_autogroup_nice() -> int | None:
    """The nice value of this process's autogroup when its session holds no process but it
    and its ancestors, else None (no autogroups, or one shared with other work)."""
    if not _session_is_ours():
        return None
    try:
        return int(AUTOGROUP.read_text().split()[-1])  # "/autogroup-85 nice 0"
    except (OSError, ValueError, IndexError):
        return None


def _session_is_ours() -> bool:
    sid, stats = os.getsid(0), {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                # after the command's closing parenthesis: state, ppid, pgrp, session, ...
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = (int(fields[1]), int(fields[3]))
    ancestors, pid = set(), os.getpid()
    while pid > 1 and pid in stats:
        ancestors.add(pid)
        pid = stats[pid][0]
    return all(p in ancestors for p, (_ppid, session) in stats.items() if session == sid)


def _set_autogroup_nice(nice: int) -> None:
    AUTOGROUP.write_text(str(nice))
