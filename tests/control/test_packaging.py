"""The base install is the CLI and the server: neither needs what only training needs."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINING_ONLY = ("torch", "megatron", "numpy", "tokenizers", "matplotlib")

#: Runs with the training-only packages made unimportable, as on a host without `[train]`.
BLOCKED = f"""
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {TRAINING_ONLY!r}:
            raise ImportError(f"{{name}} is not installed")
sys.meta_path.insert(0, Blocker())
"""


def test_base_dependencies_hold_nothing_training_only() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    assert not [name for name in TRAINING_ONLY if name in base]
    train = " ".join(project["optional-dependencies"]["train"])
    assert "torch" in train and "megatron-core" in train


def test_cli_server_and_watchdog_run_without_training_packages(tmp_path: Path) -> None:
    code = (
        BLOCKED
        + f"""
from pathlib import Path
from typer.testing import CliRunner
from supervisor.api.app import create_app
from supervisor.cli import app
from supervisor.settings import Settings
from supervisor.watchdog.reconciler import build_reconciler
from supervisor.db import Database
settings = Settings(home=Path({str(tmp_path)!r}))
db = Database(settings.db_url)
db.upgrade()
create_app(settings, database=db)
build_reconciler(settings, db, cluster=None).tick()
result = CliRunner().invoke(app, ["validate", {str(REPO / "examples" / "tiny-cpu.yaml")!r}])
assert result.exit_code == 0, result.output
print("ok")
"""
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
