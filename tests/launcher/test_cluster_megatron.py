"""The real trainer (Megatron-Core GPT, TP 2 × PP 2 on CPU) through SLURM on 2 nodes × 2 tasks."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from contracts.spec import RunSpec
from supervisor import launcher
from supervisor.layout import layout_errors
from supervisor.slurm import JobState, wait_for

from .cluster_helpers import job_logs, latest
from .conftest import REPO

pytestmark = pytest.mark.integration

PREPARE = """
import sys
from pathlib import Path
from megatron_runs import cpu_compat
cpu_compat.apply()
from megatron_runs.data_prep import prepare
prepare(None, Path(sys.argv[1]), int(sys.argv[2]))
"""


def test_megatron_tp2_pp2_on_two_nodes_trains_and_checkpoints(slurm, tmp_path, toy_plan):
    spec = RunSpec.from_file(REPO / "examples" / "tiny-cpu.yaml")
    spec = spec.model_copy(
        update={
            "name": "megatron-2x2",
            "resources": spec.resources.model_copy(update={"nodes": 2, "gpus_per_node": 2}),
            "training": spec.training.model_copy(update={"train_steps": 4, "lr_warmup_steps": 1}),
            "checkpoint": spec.checkpoint.model_copy(update={"interval_steps": 2}),
        }
    )
    assert layout_errors(spec) == []
    home = tmp_path / "home"
    # Prepared once, before the job, so four ranks do not race to build the demo corpus; in a
    # child process because cpu_compat patches torch process-wide.
    prep = subprocess.run(
        [sys.executable, "-c", PREPARE, str(home / "data"), str(spec.model.vocab_size)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert prep.returncode == 0, prep.stderr[-3000:]
    plan = replace(
        toy_plan(tmp_path, spec),
        entry="megatron_runs.train",
        env={"PYTHONPATH": str(REPO), "NIGHTWATCH_HOME": str(home)},
    )
    sub = launcher.submit(slurm, plan)
    status = wait_for(slurm, sub.job_id, lambda s: s.state.terminal, timeout_s=240, interval_s=1)
    logs = job_logs(slurm, sub.job_id, plan.log_dir)
    assert status.state is JobState.COMPLETED, logs[-4000:]
    assert len(status.nodes) == 2
    assert latest(plan.checkpoint_dir) == 4
    from contracts.checkpoints import list_checkpoints

    steps = [c.step for c in list_checkpoints(plan.checkpoint_dir)]
    assert 4 in steps and 2 in steps, steps
