"""Fixtures for the launcher tests: the real local SLURM cluster and a tiny run spec.

The cluster comes from `NIGHTWATCH_TEST_SLURM_CONF` (what `make test` exports after
`scripts/devcluster start`); without it the session starts one with the same script under
`.cluster/` and stops it at the end, unless it was already running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.spec import RunSpec
from supervisor.launcher import SubmitPlan
from supervisor.slurm import SlurmCluster, detect_slurm

REPO = Path(__file__).resolve().parents[2]
DEVCLUSTER = REPO / "scripts" / "devcluster"


def devcluster(*args: str, cluster_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEVCLUSTER), "--dir", str(cluster_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="session")
def cluster_dir() -> Path:
    conf = os.environ.get("NIGHTWATCH_TEST_SLURM_CONF")
    if conf:
        return Path(conf).resolve().parent.parent
    return Path(os.environ.get("NIGHTWATCH_DEVCLUSTER_DIR", REPO / ".cluster"))


@pytest.fixture(scope="session")
def slurm_conf(cluster_dir: Path) -> Iterator[Path]:
    conf = os.environ.get("NIGHTWATCH_TEST_SLURM_CONF")
    if conf:
        if not detect_slurm(conf):
            pytest.fail(f"NIGHTWATCH_TEST_SLURM_CONF={conf} but no controller answers")
        yield Path(conf)
        return
    if shutil.which("slurmctld") is None:
        pytest.skip("slurm-wlm is not installed (make system-packages)")
    already = devcluster("status", cluster_dir=cluster_dir).returncode == 0
    started = devcluster("start", "--nodes", "3", cluster_dir=cluster_dir)
    assert started.returncode == 0, started.stderr
    yield cluster_dir / "etc" / "slurm.conf"
    if not already:
        devcluster("stop", cluster_dir=cluster_dir)


@pytest.fixture(scope="session")
def slurm(slurm_conf: Path) -> SlurmCluster:
    return SlurmCluster(slurm_conf)


def _toy_spec(
    name: str,
    steps: int,
    nodes: int = 2,
    per_node: int = 2,
    interval: int = 5,
    time_limit: int = 10,
) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": name,
            "model": {
                "num_layers": 2,
                "hidden_size": 16,
                "num_attention_heads": 2,
                "seq_length": 16,
                "vocab_size": 64,
                "precision": "fp32",
            },
            "parallelism": {"tensor": 1, "pipeline": 1, "data": nodes * per_node},
            "resources": {
                "device": "cpu",
                "nodes": nodes,
                "gpus_per_node": per_node,
                "time_limit_minutes": time_limit,
            },
            "training": {"train_steps": steps, "global_batch_size": nodes * per_node},
            "checkpoint": {"interval_steps": interval},
        }
    )


def _toy_plan(
    tmp_path: Path,
    spec: RunSpec,
    attempt: int = 1,
    toy_env: dict[str, str] | None = None,
    **kw: object,
) -> SubmitPlan:
    return SubmitPlan(
        run_id=spec.name,
        attempt=attempt,
        spec=spec,
        checkpoint_dir=tmp_path / "ckpt",
        log_dir=tmp_path / "logs",
        entry="tests.launcher.toy_train",
        env={"PYTHONPATH": str(REPO), "TOY_STEP_SECONDS": "0.2", **(toy_env or {})},
        **kw,
    )


@pytest.fixture
def toy_spec():
    """Build a tiny spec for the toy trainer (a function, so each test picks its numbers)."""
    return _toy_spec


@pytest.fixture
def toy_plan():
    """Build a SubmitPlan that runs tests/launcher/toy_train.py on the cluster."""
    return _toy_plan
