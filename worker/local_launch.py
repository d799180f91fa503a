"""Start N ranks of `python -m megatron_runs.train` on this host (tests, smoke check, benchmarks).

Like torchrun without its agent: each rank gets the torch.distributed environment, its own
log file, and when one rank exits non-zero the others are stopped (they would otherwise wait
forever in a collective), as SLURM does with a job step whose task failed. The ranks are
forked by one launcher process that imported the training program once, with a node task's
own fork (`worker.local_ranks`): each rank importing torch and megatron-core on its own cost
≈ 8 s of wall time per launch of 4 ranks on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from contracts.logs import log_events
from contracts.restart import memory_tier_env
from worker import local_ranks

_ROOT = Path(__file__).resolve().parents[1]


#: Where `free_port` looks: below the dev clusters' fixed ports (17900 and up in the soak,
#: 18600 and 18900 in the tests), the rendezvous ports of Nightwatch's jobs (20000-29999,
#: `worker.env.master_port`) and of the soak baseline's (30000 and up), and Linux's ephemeral
#: range (32768 and up). A server started on a port a job's rank 0 later derives from its job
#: id failed that job with EADDRINUSE.
FREE_PORTS = range(10000, 17000)


def free_port() -> int:
    """A free loopback TCP port below Linux's ephemeral range (32768+), for a server that
    binds it later: rank 0's TCPStore here, and every server the demo, tests and benchmarks
    start (the one definition; this module imports nothing heavy).

    A port from bind(0) lies in the ephemeral range, and between closing it and the server
    binding it the kernel may hand it to some process's outgoing connection (seen as
    EADDRINUSE on a busy host). Ports below that range are never handed out so. They come
    from `FREE_PORTS`, clear of every port a job binds by a fixed rule.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(FREE_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {FREE_PORTS.start}-{FREE_PORTS.stop - 1}")


@dataclass
class LocalRun:
    """The ranks of one `launch`: children of one launcher process, which writes each rank's
    pid and exit code beside its log (`local_ranks`)."""

    launcher: subprocess.Popen
    logs: list[Path]
    codes: list[int | None] = field(default_factory=list)

    def events(self, rank: int = 0) -> list[dict]:
        """JSON-lines events a rank logged so far."""
        return log_events(self.logs[rank].read_text(errors="replace"))

    def losses(self) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in self.events() if e["event"] == "step"}

    def poll(self) -> list[int | None]:
        """Each rank's exit code as Popen gives it (negative: killed by that signal), None while
        it runs. A rank the launcher never reported (it failed before forking, or was killed)
        ended with the launcher's code."""
        launcher = self.launcher.poll()  # first: it records every rank it reaps before it ends
        codes = [local_ranks.read_number(local_ranks.exit_file(log)) for log in self.logs]
        return [launcher if code is None else code for code in codes]

    def signal(self, signum: int) -> None:
        """A stop signal (USR2/TERM) to every live rank: the launcher forwards it, also to the
        ranks it has not forked yet, once it has."""
        if signum not in local_ranks.STOP_SIGNALS:
            raise ValueError(f"the launcher forwards only {local_ranks.STOP_SIGNALS}, not {signum}")
        self.launcher.send_signal(signum)

    def wait(self, timeout: float, on_poll: Callable[[LocalRun], None] | None = None) -> list[int]:
        """Wait for all ranks (the launcher stops the rest `PEER_GRACE_S` after one fails,
        as a node task does: `worker.ranks.fork_ranks`); kill everything on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = self.poll()
            if all(c is not None for c in codes):
                self.launcher.wait()  # it leaves right after recording the last rank
                self.codes = codes
                return codes
            if on_poll is not None:
                on_poll(self)
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"ranks still running after {timeout}s; logs: {self.logs}")

    def kill(self) -> None:
        """SIGKILL every running rank with its process group (its helpers: a checkpoint writer,
        a data worker) and wait for the launcher, which reaps them; a launcher that has not
        forked every rank yet is killed itself (the ranks it forked die with it)."""
        pids = [local_ranks.read_number(local_ranks.pid_file(log)) for log in self.logs]
        codes = self.poll()
        if None in pids:
            self.launcher.kill()
        for pid, code in zip(pids, codes, strict=True):
            if pid is not None and code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        self.launcher.wait()


def launch(
    args: list[str],
    nproc: int,
    log_dir: Path,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    entry: tuple[str, ...] = ("-m", "megatron_runs.train"),
    memory_tiers: Sequence[Sequence[int]] | None = None,
    rank_env: Sequence[Mapping[str, str]] | None = None,
) -> LocalRun:
    """Start `nproc` ranks of `entry` (`-m module`, `-c code` or a script, as `python` takes
    them; default: the training CLI) with `args`, forked by one launcher process run by
    `python` with `env`; logs go to log_dir/rank<i>.log. `memory_tiers`: per rank, the open
    descriptors of its in-memory checkpoint slots, handed to it as a node task hands them
    (`contracts.restart`); `rank_env`: per rank, more environment (a node name per rank: ranks
    on distinct nodes), set after the import (a variable read on import is `env`'s)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    logs = [log_dir / f"rank{rank}.log" for rank in range(nproc)]
    ranks = []
    for rank, log in enumerate(logs):
        log.write_text("")
        local_ranks.pid_file(log).unlink(missing_ok=True)
        local_ranks.exit_file(log).unlink(missing_ok=True)
        fds = tuple(memory_tiers[rank]) if memory_tiers else ()
        rank_vars = {
            **(rank_env[rank] if rank_env else {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            **(memory_tier_env(fds) if fds else {}),
        }
        ranks.append({"log": str(log.absolute()), "env": rank_vars})  # its cwd is _ROOT
    launcher_env = {
        **os.environ,
        **(env or {}),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
    }
    plan = json.dumps({"entry": list(entry), "args": list(args), "ranks": ranks})
    with logs[0].open("a") as out:  # what the import prints: rank 0's, as when it imported
        launcher = subprocess.Popen(
            [python, "-m", local_ranks.__name__, plan],
            env=launcher_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=_ROOT,
            pass_fds=[fd for fds in memory_tiers or () for fd in fds],
        )
    return LocalRun(launcher=launcher, logs=logs)
