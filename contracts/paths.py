"""Where a run's files live under NIGHTWATCH_HOME (docs/contracts.md, "Paths").

The supervisor writes them, the API reads logs from them, the trainer defaults its checkpoint
directory to them: one definition for all three.
"""

from __future__ import annotations

import os
from pathlib import Path

from contracts.spec import RunSpec


def nightwatch_home() -> Path:
    """Where runs, data and caches live unless a spec says otherwise (NIGHTWATCH_HOME)."""
    return Path(os.environ.get("NIGHTWATCH_HOME", Path.home() / ".nightwatch"))


def run_dir(home: Path, run_id: str) -> Path:
    return home / "runs" / run_id


def checkpoint_dir(home: Path, run_id: str, spec: RunSpec) -> Path:
    """spec.checkpoint.dir, default $NIGHTWATCH_HOME/runs/<run id>/checkpoints."""
    if spec.checkpoint.dir:
        return Path(spec.checkpoint.dir)
    return run_dir(home, run_id) / "checkpoints"


def attempt_log_dir(home: Path, run_id: str, attempt: int) -> Path:
    """One folder per attempt: submitit creates `<job id>/` in it once sbatch answered."""
    return run_dir(home, run_id) / "logs" / f"a{attempt}"


def reserve_log_dir(home: Path, run_id: str) -> Path:
    """Where a run's reserve jobs log (`supervisor.launcher.ReserveFor`): apart from the
    attempts' folders, so that no attempt ever adopts a reserve job as its own submission."""
    return run_dir(home, run_id) / "logs" / "reserves"
