"""Start N ranks of `python -m megatron_runs.train` on this host (tests, demo, benchmarks).

Like torchrun without its agent: each rank gets the torch.distributed environment, its own
log file, and when one rank exits non-zero the others are stopped (they would otherwise wait
forever in a collective), as SLURM does with a job step whose task failed.
"""

from __future__ import annotations

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

from contracts.restart import memory_tier_env

_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free loopback TCP port below Linux's ephemeral range (32768+), for a server that
    binds it later: rank 0's TCPStore here, and every server the demo, tests and benchmarks
    start (the one definition; this module imports nothing heavy).

    A port from bind(0) lies in the ephemeral range, and between closing it and the server
    binding it the kernel may hand it to some process's outgoing connection (seen as
    EADDRINUSE on a busy host). Ports below that range are never handed out so.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def log_events(text: str) -> list[dict]:
    """The trainer's JSON-lines events in a rank's log (other output, torn lines skipped)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{") and '"event"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


@dataclass
class LocalRun:
    procs: list[subprocess.Popen]
    logs: list[Path]
    codes: list[int | None] = field(default_factory=list)

    def events(self, rank: int = 0) -> list[dict]:
        """JSON-lines events a rank logged so far."""
        return log_events(self.logs[rank].read_text(errors="replace"))

    def losses(self) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in self.events() if e["event"] == "step"}

    def signal(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def wait(self, timeout: float, on_poll: Callable[[LocalRun], None] | None = None) -> list[int]:
        """Wait for all ranks; stop the rest once one fails; kill everything on timeout."""
        deadline = time.monotonic() + timeout
        failed_at = None
        while time.monotonic() < deadline:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                self.codes = codes
                return codes
            if on_poll is not None:
                on_poll(self)
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 2.0:
                self.kill()
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"ranks still running after {timeout}s; logs: {self.logs}")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()


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
    """Start `nproc` ranks of `entry` (default: the training CLI) with `args`; logs go to
    log_dir/rank<i>.log. `memory_tiers`: per rank, the open descriptors of its in-memory
    checkpoint slots, handed to it as a node task hands them (`contracts.restart`);
    `rank_env`: per rank, more environment (a node name per rank: ranks on distinct nodes)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(nproc):
        process_env = {
            **os.environ,
            **(env or {}),
            **(rank_env[rank] if rank_env else {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
        }
        fds = tuple(memory_tiers[rank]) if memory_tiers else ()
        if fds:
            process_env.update(memory_tier_env(fds))
        log = log_dir / f"rank{rank}.log"
        with log.open("w") as fh:
            procs.append(
                subprocess.Popen(
                    [python, *entry, *args],
                    env=process_env,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=_ROOT,
                    pass_fds=fds,
                )
            )
        logs.append(log)
    return LocalRun(procs=procs, logs=logs)
