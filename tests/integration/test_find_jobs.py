"""`SlurmCluster.find_jobs` on the real cluster: the watchdog's guard against submitting an
attempt twice after the supervisor died between sbatch and recording the job id."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from supervisor.slurm import SlurmCluster, SourceUnavailable

from .conftest import Stack

pytestmark = pytest.mark.integration


def _sbatch(slurm: SlurmCluster, name: str) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", "-J", name, "-N", "1", "-o", "/dev/null", "--wrap", "sleep 1"],
        env=slurm.env, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return out.stdout.strip().split(";")[0]


def test_find_jobs_names_every_job_of_that_name(stack: Stack) -> None:
    name = f"nw-find-{uuid.uuid4().hex[:8]}"
    assert stack.slurm.find_jobs(name) == []
    first, second = _sbatch(stack.slurm, name), _sbatch(stack.slurm, name)
    _sbatch(stack.slurm, name + "-other")
    assert stack.slurm.find_jobs(name) == [first, second]


def test_find_jobs_without_a_controller_is_unknown_not_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", "")  # SlurmCluster sets it process-wide; restored after
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=nowhere\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\n")
    with pytest.raises(SourceUnavailable):
        SlurmCluster(conf, timeout_s=5).find_jobs("anything")
