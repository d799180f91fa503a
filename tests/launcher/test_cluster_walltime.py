"""Walltime continuation: a run longer than its time limit finishes as chained attempts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor import launcher
from supervisor.slurm import JobState, wait_for
from supervisor.watchdog.snapshot import Cause, FindingKind, RemedyKind

from .cluster_helpers import job_logs, latest, watchdog_remedy

pytestmark = pytest.mark.integration


def test_run_longer_than_time_limit_chains_attempts(slurm, tmp_path, toy_spec, toy_plan):
    # A 1-minute limit with SLURM's warning signal 50 s before it. slurmctld checks time limits
    # on a 30 s cycle and may warn early, so the warning lands 0–30 s into each attempt
    # (measured: 4, 19, 20, 27 s); the run needs 35 s of sleep-dominated steps (35 × 1 s), so
    # no single attempt can finish it. Driven the way the reconciler drives it: submit, poll,
    # ask the detectors and the policy, resubmit on REQUEUE.
    spec = toy_spec("walltime", steps=35, interval=1000, time_limit=1)
    plan = toy_plan(tmp_path, spec, signal_delay_s=50)
    plan = replace(plan, env={**plan.env, "TOY_STEP_SECONDS": "1.0"})
    outcomes, causes = [], []
    for attempt in range(1, 13):
        sub = launcher.submit(slurm, replace(plan, attempt=attempt))
        status = wait_for(slurm, sub.job_id, lambda s: s.state.terminal, timeout_s=120)
        step = latest(plan.checkpoint_dir)
        logs = job_logs(slurm, sub.job_id, plan.log_dir)
        remedy = watchdog_remedy(status, spec, step, logs)
        finding = remedy.finding
        outcomes.append((finding.kind if finding else status.state, step))
        causes.append(finding.cause if finding else None)
        if remedy.kind is RemedyKind.NONE:
            break
        assert remedy.kind is RemedyKind.REQUEUE, logs
    assert status.state is JobState.COMPLETED, outcomes
    assert outcomes[-1] == (JobState.COMPLETED, 35), outcomes
    # every stop before the last was the time limit (checkpointed); nothing went backwards
    assert len(outcomes) >= 2, outcomes
    # (TIMEOUT when the warning and the limit came in the same slurmctld cycle; a task the
    # warning killed before its handler was in place fails, blamed on the walltime from its
    # log: infra, requeued, nothing trained to lose)
    stops = (FindingKind.JOB_PREEMPTED, FindingKind.JOB_TIMEOUT)
    for (kind, _), cause in zip(outcomes[:-1], causes, strict=False):
        early = kind is FindingKind.JOB_FAILED and cause is Cause.INFRA
        assert kind in stops or early, (outcomes, causes)
    steps = [step for _, step in outcomes]
    assert steps == sorted(steps) and 0 < steps[-2] < 35, outcomes
