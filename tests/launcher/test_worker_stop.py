"""A node task that runs no ranks leaves at once on a stop signal (`worker.task._EarlyStop`):
one that only remembered it held its node until SLURM's KillWait, and the next job waited."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from contracts import exitcodes

ROOT = Path(__file__).resolve().parents[2]


def _run(body: str) -> subprocess.CompletedProcess[str]:
    probe = (
        "import os, signal, sys\n"
        "from worker.task import _EarlyStop, _configure_logging\n"
        "_configure_logging()\n"
        "early = _EarlyStop()\n"
        "early.install()\n" + body
    )
    return subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_a_stop_signal_while_no_ranks_run_ends_the_task_with_the_code_given() -> None:
    out = _run(
        "with early.leaving(75, {}):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    signal.pause()\n"
        "sys.exit(3)\n"
    )
    assert out.returncode == exitcodes.REQUEUE, out.stderr
    assert "stop signal 15 on a node that runs no ranks: leaving (exit 75)" in out.stderr


def test_a_signal_seen_before_the_idle_part_ends_the_task_as_it_begins() -> None:
    """TERM while ranks ran (they save; the node task only remembers it), then the ranks
    failed and the node would wait for a restart order: it leaves with their code instead."""
    out = _run(
        "os.kill(os.getpid(), signal.SIGUSR2)\n"
        "print('remembered', early.signum, flush=True)\n"
        "with early.leaving(1, {}):\n"
        "    sys.exit(3)\n"
    )
    assert out.returncode == 1 and out.stdout == f"remembered {int(signal.SIGUSR2)}\n"


def test_outside_the_idle_part_a_signal_is_only_remembered() -> None:
    out = _run(
        "with early.leaving(75, {}):\n"
        "    pass\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('remembered', early.signum, flush=True)\n"
    )
    assert out.returncode == 0 and out.stdout == f"remembered {int(signal.SIGTERM)}\n"
