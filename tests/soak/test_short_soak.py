"""The short chaos soak (≈ 5-7 min) on the real stack, asserting what a short soak can show.

Real SLURM (scripts/devcluster), real Prometheus, a PostgreSQL-backed supervisor and CPU
Megatron-Core training; three fault kinds (data, crash, sick node). Runs as a subprocess so
its cluster and supervisor are stopped whatever happens. Part of `make test`; the seed is
fixed (3) so a failure replays, `NIGHTWATCH_SOAK_SEED` draws another schedule,
`NIGHTWATCH_SOAK_BASE_PORT` moves its devcluster's ports (beside another soak), and
`NIGHTWATCH_SOAK=0` skips it. The loss must equal, step for step, that of a reference that saw
the same samples and applied the same updates (`benchmarks/soak/reference.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("NIGHTWATCH_SOAK") == "0", reason="NIGHTWATCH_SOAK=0"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="slurm-wlm not installed"),
]


@pytest.fixture
def out() -> Path:
    """A short directory: the devcluster's Unix sockets live under it (pytest's tmp_path is
    too long for them). Kept afterwards: the soak's log and every job's output are the
    evidence when it fails."""
    return Path(tempfile.mkdtemp(prefix="nw-soak-"))


def _problems(nw: dict[str, Any]) -> list[str]:
    """Every acceptance point the Nightwatch side missed, one line each."""
    problems = [
        f"{f['kind']} at step {f['at_step']}: {what}"
        for f in nw["faults"]
        for what, ok in (
            ("never happened", f["triggered"]),
            (f"cured by {f['cured_by']} (remedies {f['remedies']})", f["right_action"]),
            ("no recovery seen", f["recovered"]),
        )
        if not ok
    ]
    if not nw["reached_target"]:
        problems.append(f"stopped at step {nw['final_step']} of {nw['target_steps']}")
    if not nw["loss_equal"]:
        problems.append(
            f"loss differs from the exact reference at {nw['loss_steps_unequal']} of "
            f"{nw['loss_steps_compared']} steps: {nw['loss_mismatches']}"
        )
    if nw["escalations"]:
        problems.append(f"{nw['escalations']} escalation(s)")
    return problems


def test_short_soak_cures_every_fault_and_matches_the_reference(out: Path) -> None:
    seed = os.environ.get("NIGHTWATCH_SOAK_SEED", "3")
    port = os.environ.get("NIGHTWATCH_SOAK_BASE_PORT")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "chaos_soak.py"), "--short", "--seed", seed,
         "--out", str(out), *(["--base-port", port] if port else [])],
        capture_output=True, text=True, timeout=1800, cwd=REPO,
    )  # fmt: skip
    results = list(out.glob("*/result.json"))
    log = "\n".join(line for line in proc.stdout.splitlines() if "warn" not in line.lower())
    if not results:
        pytest.fail(f"no result in {out}\n{log[-4000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(results[0].read_text())
    nw = next(s for s in result["scores"] if s["system"] == "nightwatch")
    problems = _problems(nw) + result["acceptance_failed"]
    if problems:
        pytest.fail("\n".join([*problems, f"(everything is in {out})", log[-6000:]]))
