"""The launcher process of `launch_local`: import the training program once, then fork the ranks.

Why: every rank of `python -m megatron_runs.train` imported torch and megatron-core on its own
(≈ 4 core-seconds); on a 2-core machine 4 ranks spent ≈ 8 s of wall time importing at every
local launch (the training tests, the smoke check, the benchmarks). A production node task
forks its ranks after one import (`worker.ranks`); this is its local equivalent, small and
separate because `megatron_runs` may not import `worker`.

`python -m megatron_runs.local_ranks <plan>`, the plan being the JSON `launch_local.launch`
writes: the entry (`-m module`, `-c code` or a script, as `python` takes them), its arguments,
and per rank a log file and the environment of its own. A `-m` module is imported here, and
its `preload()` run, as a node task does. Each rank is then a child in its own session (a
killpg of its pid stops its helpers too) that writes its pid beside its log, sends its output
there and runs the entry as `python` would run it. This process forwards USR2/TERM to the
ranks (also one that came before they were forked), records each rank's exit code beside its
log as Popen would give it (negative: killed by that signal), and leaves once all have ended;
a rank dies with it. What the import prints (warnings, an import error) goes to rank 0's log.

CUDA must not be initialised before the fork (torch refuses CUDA in a forked child): the
NVML-based availability check is asked for, and the launcher refuses to fork if CUDA is up.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import signal
import sys
import traceback
import types
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

#: The signals a scheduler sends to stop a job with a checkpoint; forwarded to every rank.
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


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


def _preload(entry: Sequence[str]) -> None:
    """Import a `-m` entry and what its `preload()` names, once, for every rank (`worker.task`
    does the same on a node)."""
    if entry[0] != "-m":
        return
    preload = getattr(importlib.import_module(entry[1]), "preload", None)
    if preload is not None:
        preload()


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _die_with(parent: int) -> None:
    """SIGKILL this rank when the launcher dies (killed before it forked every rank, or
    crashed): a rank must not train on, unseen, with nobody to record how it ended."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _become_rank(log: Path, env: dict[str, str], parent: int, mask: set[int]) -> None:
    """In a forked child: its own session, its pid and output beside its log, its environment,
    and the stop signals back to what a fresh `python` has (the forwarder resends any it saw)."""
    os.setsid()
    _die_with(parent)
    record(pid_file(log), os.getpid())
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _leave(code: int) -> NoReturn:
    """End a rank here, never returning into the launcher's loop, and without the interpreter's
    teardown (a process group with a dead peer can hang it), as the training CLI ends."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _send(children: dict[int, Path], signum: int) -> None:
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def main(plan: dict) -> NoReturn:
    """Import, fork every rank of `plan`, forward stop signals, record exit codes; leave once
    every rank has ended."""
    entry, args = plan["entry"], plan["args"]
    children: dict[int, Path] = {}  # pid → the rank's log
    seen: list[int] = []

    def forward(signum: int, frame: object) -> None:
        seen.append(signum)
        _send(children, signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    _preload(entry)
    if _cuda_initialised():
        raise RuntimeError("CUDA was initialised before the ranks were forked")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    for rank in plan["ranks"]:
        log = Path(rank["log"])
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _become_rank(log, rank["env"], parent, mask)
                code = run_entry(entry, args)
            except BaseException:
                traceback.print_exc()
            finally:
                _leave(code)
        children[pid] = log
    for signum in dict.fromkeys(seen):  # a stop that came before a rank's fork
        _send(children, signum)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    while children:
        pid, status = os.wait()
        log = children.pop(pid, None)  # None: a child the import left behind, not a rank
        if log is not None:
            record(exit_file(log), os.waitstatus_to_exitcode(status))
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
