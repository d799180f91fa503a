"""Which cluster this process talks to, and waiting on one job (for scripts and tests)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from supervisor.slurm.cli import SlurmCluster, detect_slurm
from supervisor.slurm.local import LocalCluster
from supervisor.slurm.types import Cluster, JobState, JobStatus, SourceUnavailable


def make_cluster(
    slurm_conf: str | Path | None = None, executor: str = "auto"
) -> SlurmCluster | LocalCluster:
    """`executor` "slurm" or "local" as configured; "auto": SLURM when a controller answers,
    else the embedded local executor."""
    conf = slurm_conf or os.environ.get("SLURM_CONF")
    if executor == "local":
        return LocalCluster()
    if executor == "slurm" or detect_slurm(conf):
        return SlurmCluster(conf)
    return LocalCluster()


def wait_for(
    cluster: Cluster,
    job_id: str,
    until: Callable[[JobStatus], bool],
    timeout_s: float,
    interval_s: float = 0.5,
) -> JobStatus:
    """Poll one job until `until(status)`; for scripts and tests, the reconciler polls itself."""
    deadline = time.monotonic() + timeout_s
    status = JobStatus(job_id=job_id, state=JobState.UNKNOWN)
    while time.monotonic() < deadline:
        try:
            status = cluster.poll([job_id])[job_id]
        except SourceUnavailable:
            status = JobStatus(job_id=job_id, state=JobState.UNKNOWN)
        if until(status):
            return status
        time.sleep(interval_s)
    raise TimeoutError(f"job {job_id} still {status.state} after {timeout_s}s")
