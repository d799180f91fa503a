"""The short chaos soak (≈ 5-7 min) on the real stack, asserting what a short soak can show.

Real SLURM (scripts/devcluster), real Prometheus, a PostgreSQL-backed supervisor and CPU
Megatron-Core training; three fault kinds (data, crash, sick node). Runs as a subprocess so
its cluster and supervisor are stopped whatever happens. Part of `make test`; the seed is
fixed (3) so a failure replays, `NIGHTWATCH_SOAK_SEED` draws another schedule, and
`NIGHTWATCH_SOAK=0` skips it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("NIGHTWATCH_SOAK") == "0", reason="NIGHTWATCH_SOAK=0"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="slurm-wlm not installed"),
]


@pytest.fixture
def out() -> Iterator[Path]:
    """A short directory: the devcluster's Unix sockets live under it (pytest's tmp_path is
    too long for them)."""
    path = Path(tempfile.mkdtemp(prefix="nw-soak-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_short_soak_cures_every_fault_and_matches_the_reference(out: Path) -> None:
    seed = os.environ.get("NIGHTWATCH_SOAK_SEED", "3")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "chaos_soak.py"), "--short", "--seed", seed,
         "--out", str(out)],
        capture_output=True, text=True, timeout=1800, cwd=REPO,
    )  # fmt: skip
    results = list(out.glob("*/result.json"))
    assert results, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(results[0].read_text())
    nw = next(s for s in result["scores"] if s["system"] == "nightwatch")
    context = proc.stdout[-3000:]
    for fault in nw["faults"]:
        assert fault["triggered"], (fault, context)
        assert fault["right_action"], (fault, context)
        assert fault["recovered"], (fault, context)
    assert nw["reached_target"], context
    assert nw["loss_rel_diff"] is not None and nw["loss_rel_diff"] <= 0.02, context
    assert nw["escalations"] == 0, context
    assert result["acceptance_failed"] == [], context
