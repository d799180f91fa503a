"""One task per node: import the training program once, then fork the node's ranks from it.

Why: a rank that is its own scheduler task imports torch and megatron-core on its own at
every (re)start. On a node with fewer cores than ranks those imports share the cores (on the
2-core development VM, 4 ranks: 14.1 s to the first step as tasks, 6.1 s forked;
`benchmarks/restart_cost.py`), and on a GPU cluster 8 ranks per node read the same thousands
of files from a shared file system. A fork after the import shares the imported modules
(copy-on-write, with `gc.freeze`) and costs milliseconds.

The parent (the node's task) trains nothing. It forwards the stop signals (USR2/TERM) to its
ranks and ends with their outcome: the first rank that fails decides it, and its peers are
given `PEER_GRACE_S` to fail on their own (a collective with a dead peer raises within
milliseconds, and their tracebacks are evidence for the crash blame) before they are killed,
so a crashed rank ends its job at once (docs/contracts.md, "Node task").

CUDA must not be initialised before the fork; `fork_ranks` refuses if it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

from contracts import exitcodes
from worker.env import TaskInfo

#: How long the peers of a failed rank may take to fail on their own before they are killed.
PEER_GRACE_S = 2.0
#: How often the node task looks for ranks that ended (a crash ends its job this much later).
REAP_INTERVAL_S = 0.05
#: The signals a scheduler sends to stop a job with a checkpoint (walltime, preemption).
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
#: The node task's own name once it forks: `ps` shows `nw-node` over its `nw-rank<N>`s.
NODE_PROCESS_NAME = "nw-node"
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def node_outcome(codes: Sequence[int]) -> int:
    """The task's outcome from its ranks' in the order they ended, as
    `os.waitstatus_to_exitcode` gives them (negative: killed by that signal).

    The first failure is the cause and the rest its consequences (peers whose collective broke,
    or that were killed after the grace), so it wins; otherwise a requeue beats success.
    """
    for code in codes:
        if _failed(code):
            return code
    return exitcodes.REQUEUE if exitcodes.REQUEUE in codes else exitcodes.OK


def _failed(code: int) -> bool:
    """Neither done nor checkpointed on a stop signal: an error code or a killing signal."""
    return code not in exitcodes.CLEAN_EXITS


def name_process(name: str) -> None:
    """Set `/proc/<pid>/comm` (what ps, top and a fault injector see): `nw-rank3`, where every
    forked rank would otherwise show its parent's `python` and environment."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def die_with_parent(parent: int) -> None:
    """SIGKILL this rank when its node task dies: a rank outliving it would be reparented
    away from the job's process tree, where a scheduler tracking processes by parentage
    (SLURM's proctrack/linuxproc) no longer finds it to cancel."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def rank_process_name(rank: int) -> str:
    """What a forked rank calls itself in /proc/<pid>/comm (15 characters at most)."""
    return f"nw-rank{rank}"


def _prctl(option: int, arg: object) -> None:
    """Linux's prctl(2); elsewhere (a developer's laptop) there is nothing to set."""
    if sys.platform.startswith("linux"):
        if ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl({option}): {os.strerror(errno)}")


def preload_module(name: str) -> None:
    """Import the training program `name` (and what its `preload()` names) once, before the
    fork, so that every rank shares it."""
    preload = getattr(importlib.import_module(name), "preload", None)
    if preload is not None:
        preload()


def leave(code: int) -> NoReturn:
    """End this process (a node task, a rank) with `code` and without the interpreter's
    teardown, as `python -m megatron_runs.train` does: a process group with a dead peer can
    hang it, and a task that does not exit keeps its job RUNNING, so a rank's crash looked like
    a hang of the whole job (sacct shows the code: FAILED 75:0 for a checkpointed preemption;
    submitit's result pickle is not written, nothing reads it). A negative code is a rank
    killed by that signal: the task dies by it too, so SLURM reports the kill as it did when
    the rank was the task."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's action cannot be set
            signal.signal(-code, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the rank's crash, not a core of ours
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def fork_ranks(
    ranks: Sequence[TaskInfo],
    run_rank: Callable[[TaskInfo], int],
    leave: Callable[[int], object],
    grace_s: float = PEER_GRACE_S,
    interrupt: Callable[[], bool] | None = None,
    on_ended: Callable[[TaskInfo, int], object] | None = None,
) -> int | None:
    """Fork one child per rank; each runs `run_rank(info)` and ends with `leave(code)` (which
    must not return). Returns the node's outcome (`node_outcome`) once every child has ended,
    or None when `interrupt()` (asked between reaps) said to stop them: every child is then
    killed and reaped first, so the node's ranks are all gone when this returns.
    `on_ended(info, code)` hears of each rank that ended on its own, as it is reaped.

    No stop signal is lost or misdirected. The forwarder is installed before the first fork
    and remembers what it saw; a child starts with signals blocked, puts back the handlers the
    forwarder replaced (the worker's early-stop recorder), hands them what the parent had seen
    by its fork, then unblocks; after the last fork the parent sends everything it saw to every
    child again (a stop is idempotent), for a signal that came between a fork and the child's
    registration. Blocking in one thread does not keep a signal from the process's other
    threads (a test runner has some), which is why the forwarder must be in place throughout.
    """
    if _cuda_initialised():
        raise RuntimeError("CUDA was initialised before the ranks were forked")
    children: dict[int, TaskInfo] = {}
    seen: list[int] = []

    def forward(signum: int, frame: object) -> None:
        seen.append(signum)
        _send(children, signum)

    handlers = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    try:
        for info in ranks:
            pid = os.fork()
            if pid == 0:
                try:
                    die_with_parent(parent)
                    _take_over_signals(handlers, seen)
                    signal.pthread_sigmask(signal.SIG_SETMASK, previous)
                    name_process(rank_process_name(info.global_rank))
                    leave(run_rank(info))
                finally:
                    os._exit(1)  # a child never returns into its parent's code
            children[pid] = info
        for signum in dict.fromkeys(seen):
            _send(children, signum)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        return _wait(children, grace_s, interrupt, on_ended)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _send(children: dict[int, TaskInfo], signum: int) -> None:
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _take_over_signals(handlers: dict[int, object], seen: Sequence[int]) -> None:
    """In a new rank: its own handlers back, and the stops its parent saw before the fork."""
    for sig, handler in handlers.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
    for signum in dict.fromkeys(seen):
        handler = handlers.get(signum)
        if callable(handler):
            handler(signum, None)


def _wait(
    children: dict[int, TaskInfo],
    grace_s: float,
    interrupt: Callable[[], bool] | None = None,
    on_ended: Callable[[TaskInfo, int], object] | None = None,
) -> int | None:
    """Reap every child; after the first failure, kill whoever is left after `grace_s`; on
    `interrupt()`, kill them all at once and return None once they are reaped.

    Each by its pid, never `waitpid(-1)`: that would also reap children that are not ranks
    (a test runner's, for one), whose owners then wait in vain."""
    codes: list[int] = []
    deadline: float | None = None
    while children:
        ended = [(pid, status) for pid in list(children) if (status := _reaped(pid)) is not None]
        for pid, status in ended:
            info = children.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            codes.append(code)
            if on_ended is not None:
                on_ended(info, code)
            if deadline is None and _failed(code):
                deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() >= deadline:
            _send(children, signal.SIGKILL)
            deadline = float("inf")
        if interrupt is not None and interrupt():
            _send(children, signal.SIGKILL)
            for pid in list(children):
                os.waitpid(pid, 0)
            return None
        if children and not ended:
            time.sleep(REAP_INTERVAL_S)
    return node_outcome(codes)


def _reaped(pid: int) -> int | None:
    """The wait status of a child that has ended, else None."""
    done, status = os.waitpid(pid, os.WNOHANG)
    return status if done else None
