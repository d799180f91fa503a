"""Small waits and readers shared by the cluster tests, and the watchdog's reading of a
real job's ending."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from contracts.spec import RunSpec
from supervisor.metrics_in import MetricsView, SourceHealth
from supervisor.slurm import JobState, JobStatus, SlurmCluster, tail
from supervisor.watchdog.blame import log_cause
from supervisor.watchdog.detectors import detect_all
from supervisor.watchdog.policy import decide
from supervisor.watchdog.snapshot import JobView, Remedy, RunHistory, Snapshot


def wait_until(
    what: str, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def all_nodes_idle(slurm: SlurmCluster, timeout_s: float = 60) -> None:
    """Before a job with spares, which starts on as many of its nodes as are free
    (`--nodes=<min>-<max>`): the last test's job may still be leaving a node."""
    idle = lambda: all(n.idle for n in slurm.nodes().values())  # noqa: E731
    wait_until("every node idle", idle, timeout_s)


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


def watchdog_remedy(
    status: JobStatus, spec: RunSpec, disk_step: int, log_text: str | None = None
) -> Remedy:
    """What the watchdog's detectors and policy make of a real job's polled status on a
    run's first fault (REQUEUE: a checkpointed stop continues as a new attempt; NONE: the
    target was reached, the run is done), with the blame the reconciler reads from a failed
    job's log when `log_text` is given."""
    cause = None
    if log_text is not None and status.state is JobState.FAILED:
        cause, _, _ = log_cause(log_text, status.exit_code, disk_step > 0, status.nodes)
    job = JobView(
        health=SourceHealth.UP,
        state=status.state.attempt_state,
        job_id=status.job_id,
        nodes=status.nodes,
        exit_code=status.exit_code,
        reason=status.reason or None,
        failed_nodes=status.failed_nodes,
        cause=cause,
    )
    snap = Snapshot(
        run_id=spec.name,
        attempt=1,
        now=time.time(),
        metrics=MetricsView(SourceHealth.MISSING),
        job=job,
        target_steps=spec.training.train_steps,
        disk_checkpoint_step=disk_step,
    )
    return decide(snap, detect_all(snap, spec.recovery), RunHistory(), spec.recovery)
