"""Fixtures of the training tests: a cached demo dataset and a helper to run 1–4 CPU ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from train_helpers import VOCAB

from worker.local_launch import LocalRun, launch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def nw_home() -> Path:
    """NIGHTWATCH_HOME holding the demo corpus, prepared once per machine (fingerprinted,
    file-locked) and reused by every session; runs use it through `data.prefix: null`."""
    home = Path(
        os.environ.get("NIGHTWATCH_TEST_HOME", Path(tempfile.gettempdir()) / "nightwatch-test-home")
    )
    code = (
        "from pathlib import Path; from megatron_runs.data_prep import prepare; "
        f"print(prepare(None, Path({str(home / 'data')!r}), {VOCAB}).prefix)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=300)
    return home


RunFn = Callable[..., LocalRun]


@pytest.fixture(scope="session")
def run_train(nw_home: Path, tmp_path_factory: pytest.TempPathFactory) -> RunFn:
    """Start ranks of `python -m megatron_runs.train`; returns the LocalRun (not waited)."""

    def start(
        spec: dict,
        ckpt: Path,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        memory_tiers: list[tuple[int, ...]] | None = None,
        rank_env: list[dict[str, str]] | None = None,
    ) -> LocalRun:
        p = spec["parallelism"]
        nproc = p["tensor"] * p["pipeline"] * p["data"]
        work = tmp_path_factory.mktemp(spec["name"])
        spec_path = work / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(spec))
        args = ["--spec", str(spec_path), "--checkpoint-dir", str(ckpt), *(extra or [])]
        run_env = {"NIGHTWATCH_HOME": str(nw_home), "PYTHONWARNINGS": "ignore", **(env or {})}
        return launch(
            args, nproc, work / "logs", env=run_env, memory_tiers=memory_tiers, rank_env=rank_env
        )

    return start
