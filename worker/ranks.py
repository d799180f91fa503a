"""One task per node: import the training program once, then fork the node's ranks from it.

Why: every rank used to be its own scheduler task, and every task imported torch and
megatron-core on its own at every (re)start. On a node with fewer cores than ranks those
imports share the cores: on the 2-core development VM they were most of a restart (4 ranks:
5.0 s against 2.8 s for 2, docs/benchmarks.md), and on a GPU cluster 8 ranks per node read the
same thousands of files from a shared file system. A fork after the import shares the imported
modules (copy-on-write, with `gc.freeze`) and costs milliseconds.

The parent (the node's task) trains nothing. It forwards the stop signals (USR2/TERM) to its
ranks and ends with their outcome: the first rank that fails decides it, and its peers are
given `PEER_GRACE_S` to fail on their own (a collective with a dead peer raises within
milliseconds, and their tracebacks are evidence for the crash blame) before they are killed,
so a crashed rank ends its job at once (docs/contracts.md "Worker").

CUDA must not be initialised before the fork; `fork_ranks` refuses if it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from worker.env import TaskInfo

#: How long the peers of a failed rank may take to fail on their own before they are killed.
PEER_GRACE_S = 2.0
#: The signals a scheduler sends to stop a job with a checkpoint (walltime, preemption).
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
EXIT_REQUEUE = 75  # megatron_runs.exitcodes.REQUEUE: checkpointed on a stop signal
#: The node task's own name once it forks: `ps` shows `nw-node` over its `nw-rank<N>`s.
NODE_PROCESS_NAME = "nw-node"
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def node_outcome(codes: Sequence[int]) -> int:
    """The task's outcome from its ranks' in the order they ended, as
    `os.waitstatus_to_exitcode` gives them (negative: killed by that signal).

    The first failure is the cause and the rest its consequences (peers whose collective broke,
    or that were killed after the grace), so it wins; otherwise a requeue (75) beats success.
    """
    for code in codes:
        if code not in (0, EXIT_REQUEUE):
            return code
    return EXIT_REQUEUE if EXIT_REQUEUE in codes else 0


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
    return f"nw-rank{rank}"


def _prctl(option: int, arg: object) -> None:
    """Linux's prctl(2); elsewhere (a developer's laptop) there is nothing to set."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def fork_ranks(
    ranks: Sequence[TaskInfo],
    run_rank: Callable[[TaskInfo], int],
    leave: Callable[[int], object],
    grace_s: float = PEER_GRACE_S,
) -> int:
    """Fork one child per rank; each runs `run_rank(info)` and ends with `leave(code)` (which
    must not return). Returns the node's outcome (`node_outcome`) once every child has ended.

    Stop signals are blocked across the forks: a child starts with its parent's handlers (the
    worker's early-stop recorder), and the parent installs its forwarder only after the last
    fork, so a signal in between is held, then forwarded, never lost.
    """
    if _cuda_initialised():
        raise RuntimeError("CUDA was initialised before the ranks were forked")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, TaskInfo] = {}
    parent = os.getpid()
    for info in ranks:
        pid = os.fork()
        if pid == 0:
            try:
                die_with_parent(parent)
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
                name_process(rank_process_name(info.global_rank))
                leave(run_rank(info))
            finally:
                os._exit(1)  # a child never returns into its parent's code
        children[pid] = info

    def forward(signum: int, frame: object) -> None:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    handlers = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    try:
        return _wait(children, grace_s)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _wait(children: dict[int, TaskInfo], grace_s: float) -> int:
    """Reap every child; after the first failure, kill whoever is left after `grace_s`."""
    codes: list[int] = []
    deadline: float | None = None
    while children:
        if deadline is None:
            pid, status = os.waitpid(-1, 0)
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() >= deadline:
                    for left in children:
                        os.kill(left, signal.SIGKILL)
                    deadline = float("inf")
                time.sleep(0.02)
                continue
        if pid not in children:
            continue
        del children[pid]
        code = os.waitstatus_to_exitcode(status)
        codes.append(code)
        if deadline is None and code not in (0, EXIT_REQUEUE):
            deadline = time.monotonic() + grace_s
    return node_outcome(codes)
