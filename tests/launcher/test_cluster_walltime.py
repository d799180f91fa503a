"""Walltime continuation: a run longer than its time limit finishes as chained attempts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor import launcher
from supervisor.slurm import JobState, wait_for

from .cluster_helpers import job_logs, latest

pytestmark = pytest.mark.integration


def test_run_longer_than_time_limit_chains_attempts(slurm, tmp_path, toy_spec, toy_plan):
    # 1-minute limit, SLURM's warning signal 50 s before it: each attempt gets ≈ 10 s, the
    # run needs ≈ 15 s of steps, so it can only finish as a chain. Driven here the way the
    # reconciler drives it: submit, poll, ask `continuation`, resubmit.
    spec = toy_spec("walltime", steps=45, interval=1000, time_limit=1)
    plan = toy_plan(tmp_path, spec, signal_delay_s=50)
    outcomes = []
    for attempt in range(1, 6):
        sub = launcher.submit(slurm, replace(plan, attempt=attempt))
        status = wait_for(slurm, sub.job_id, lambda s: s.state.terminal, timeout_s=120)
        outcomes.append((launcher.attempt_state(status), latest(plan.checkpoint_dir)))
        nxt = launcher.continuation(status, latest(plan.checkpoint_dir), spec.training.train_steps)
        assert nxt.next is not launcher.Next.NOT_MINE, job_logs(slurm, sub.job_id, plan.log_dir)
        if nxt.next is launcher.Next.DONE:
            break
    assert outcomes[-1] == ("completed", 45), outcomes
    assert len(outcomes) >= 2, outcomes
    # every stop before the last was a checkpointed walltime signal that made progress
    steps = [step for _, step in outcomes]
    assert all(state == "preempted" for state, _ in outcomes[:-1]), outcomes
    assert steps == sorted(set(steps)), outcomes
    assert status.state is JobState.COMPLETED
