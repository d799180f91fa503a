"""Small waits and readers shared by the cluster tests."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from supervisor.slurm import SlurmCluster, tail


def wait_until(
    what: str, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def latest(ckpt: Path) -> int:
    marker = ckpt / "latest"
    return int(marker.read_text()) if marker.exists() else 0


def job_logs(slurm: SlurmCluster, job_id: str, log_dir: Path) -> str:
    return "".join(tail(p) for p in slurm.log_files(job_id, log_dir))


def scrape_step(host: str, port: int) -> float | None:
    """`nightwatch_train_step` straight from a worker's /metrics (None while unreachable)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=1) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("nightwatch_train_step{"):
            return float(line.rsplit(" ", 1)[1])
    return None
