"""The launcher process of `worker.local_launch`: a node task for one host without a scheduler.

Why: every rank of `python -m megatron_runs.train` imported torch and megatron-core on its own
(≈ 4 core-seconds); on a 2-core machine 4 ranks spent ≈ 8 s of wall time importing at every
local launch (the training tests, the smoke check, the benchmarks). This process imports the
training program once and forks the ranks with the node task's own `worker.ranks.fork_ranks`,
so local ranks start, are signalled, named and stopped as a node's are.

`python -m worker.local_ranks <plan>`, the plan being the JSON `local_launch.launch` writes: the
entry (`-m module`, `-c code` or a script, as `python` takes them), its arguments, and per rank
a log file and the environment of its own. A `-m` module is imported here, and its `preload()`
run. Each rank is then a child in its own session (a killpg of its pid stops its helpers too)
that writes its pid beside its log, sends its output there and runs the entry as `python`
would run it, with the stop signals' default actions, as a fresh `python` has them: a USR2/TERM
that came before it (also before the fork, during the import) reaches it then. This process
records each rank's exit code beside its log as Popen would give it (negative: killed by that
signal) and leaves once all have ended; when one fails, its peers are killed after
`worker.ranks.PEER_GRACE_S`, as on a node. What the import prints goes to rank 0's log.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from worker.env import TaskInfo
from worker.ranks import STOP_SIGNALS, fork_ranks, leave, preload_module

#: The job id a local launch's ranks carry (`TaskInfo.job_id`): there is no scheduler.
LOCAL_JOB = "local"


def pid_file(log: Path) -> Path:
    """Where a rank writes its pid (once its own session exists), beside its log."""
    return log.with_suffix(".pid")


def exit_file(log: Path) -> Path:
    """Where the launcher records a rank's exit code once it has reaped it."""
    return log.with_suffix(".exit")


def read_number(path: Path) -> int | None:
    """The number `record` wrote to `path`, None while there is none."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return None


def record(path: Path, value: int) -> None:
    """Write `value` whole: a reader polling for the file never sees half of it."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(str(value))
    os.replace(partial, path)


def run_entry(entry: Sequence[str], args: Sequence[str]) -> int:
    """Run `entry` with `args` in this process as `python <entry> <args>` would (as `__main__`,
    `sys.argv` set); the exit code it would end with, an uncaught exception's traceback
    printed. The interpreter's teardown is the caller's to skip."""
    try:
        if entry[0] == "-m":
            sys.argv = ["-m", *entry[2:], *args]  # run_module puts the module's file first
            sys.modules.pop(entry[1], None)  # preloaded: `python -m` runs a fresh copy
            runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
        elif entry[0] == "-c":
            sys.argv = ["-c", *entry[2:], *args]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(entry[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [*entry, *args]
            sys.path[0] = str(Path(entry[0]).resolve().parent)
            runpy.run_path(entry[0], run_name="__main__")
    except SystemExit as exc:
        return _exit_status(exc.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _exit_status(code: object) -> int:
    """What `python` exits with on `SystemExit(code)`: None is 0, an int itself, anything else
    is printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


class _Seen:
    """The launcher's handler of the stop signals until the ranks are forked, and a new rank's
    until it runs the entry: remembers each, for the rank to receive with its default action."""

    def __init__(self) -> None:
        self.signals: list[int] = []

    def __call__(self, signum: int, frame: object) -> None:
        self.signals.append(signum)


def _become_rank(log: Path, env: dict[str, str], seen: _Seen) -> None:
    """In a forked rank: its own session, its pid and output beside its log, its environment,
    the stop signals' default actions, and any stop that came before it."""
    os.setsid()
    record(pid_file(log), os.getpid())
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    for signum in dict.fromkeys(seen.signals):
        os.kill(os.getpid(), signum)


def main(plan: dict) -> NoReturn:
    """Import, fork every rank of `plan`, record their exit codes; leave once every rank has
    ended."""
    entry, args, ranks = plan["entry"], plan["args"], plan["ranks"]
    seen = _Seen()
    for sig in STOP_SIGNALS:
        signal.signal(sig, seen)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if entry[0] == "-m":
        preload_module(entry[1])
    infos = [
        TaskInfo(LOCAL_JOB, ("127.0.0.1",), rank, rank, len(ranks), 1) for rank in range(len(ranks))
    ]

    def run_rank(info: TaskInfo) -> int:
        rank = ranks[info.global_rank]
        _become_rank(Path(rank["log"]), rank["env"], seen)
        return run_entry(entry, args)

    def ended(info: TaskInfo, code: int) -> None:
        record(exit_file(Path(ranks[info.global_rank]["log"])), code)

    fork_ranks(infos, run_rank, leave, on_ended=ended)
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
