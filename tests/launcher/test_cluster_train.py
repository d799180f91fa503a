"""A 2-node × 2-task job through SLURM: ranks, completion, checkpoints, sacct state."""

from __future__ import annotations

import pytest

from supervisor import launcher
from supervisor.models import AttemptState
from supervisor.slurm import JobState, NodeState, tail, wait_for

pytestmark = pytest.mark.integration


def test_two_nodes_two_tasks_train_to_completion(slurm, tmp_path, toy_spec, toy_plan):
    spec = toy_spec("complete", steps=8, interval=4)
    plan = toy_plan(tmp_path, spec)
    sub = launcher.submit(slurm, plan)
    status = wait_for(slurm, sub.job_id, lambda s: s.state.terminal, timeout_s=120)
    logs = "".join(tail(p) for p in slurm.log_files(sub.job_id, plan.log_dir))
    assert status.state is JobState.COMPLETED, logs
    assert status.exit_code == 0
    assert len(status.nodes) == 2 and set(status.nodes) <= {"n1", "n2", "n3"}
    assert (tmp_path / "ckpt" / "latest").read_text() == "8"
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == [
        "iter_0000004",
        "iter_0000008",
    ]
    # every rank saw the same world and the master came from the allocation's first node
    for rank in range(4):
        assert f"toy: rank {rank}/4 on " in logs
    assert status.state.attempt_state is AttemptState.COMPLETED


def test_drain_and_resume_a_node(slurm):
    node = sorted(slurm.nodes())[-1]
    slurm.drain(node, "nightwatch test")
    try:
        info = slurm.nodes()[node]
        assert info.drained and info.reason == "nightwatch test"
    finally:
        slurm.resume_node(node)
    back = slurm.nodes()[node].state
    assert back in {NodeState.IDLE, NodeState.ALLOCATED, NodeState.MIXED}
