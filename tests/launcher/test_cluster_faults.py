"""Node failure, preemption and requeue on the real local SLURM cluster."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest

from supervisor import launcher
from supervisor.models import AttemptState
from supervisor.slurm import JobState, wait_for
from supervisor.watchdog.snapshot import RemedyKind

from .cluster_helpers import job_logs, latest, scrape_step, wait_until, watchdog_remedy
from .conftest import devcluster
from .endpoints import EndpointRegistry

pytestmark = pytest.mark.integration


def start_steps(logs: str) -> set[int]:
    return {int(m) for m in re.findall(r"starts at step (\d+)", logs)}


def test_node_failure_reports_node_and_resubmission_lands_on_spare(
    slurm, cluster_dir, tmp_path, toy_spec, toy_plan
):
    nodes = set(slurm.nodes())
    assert len(nodes) >= 3, f"needs a spare node: start the cluster with --nodes 3, got {nodes}"
    spec = toy_spec("nodefail", steps=24, interval=3)
    plan = toy_plan(tmp_path, spec)
    ckpt = plan.checkpoint_dir
    sub = launcher.submit(slurm, plan)
    running = wait_for(
        slurm, sub.job_id, lambda s: s.state is JobState.RUNNING and len(s.nodes) == 2, 60
    )
    wait_until("a first checkpoint", lambda: latest(ckpt) >= 3, 60)
    victim = running.nodes[1]
    spares = nodes - set(running.nodes)
    assert devcluster("kill-node", victim, cluster_dir=cluster_dir).returncode == 0
    killed_at = time.monotonic()
    try:
        failed = wait_for(slurm, sub.job_id, lambda s: s.state.terminal, timeout_s=60)
        print(f"kill-node → NODE_FAIL polled: {time.monotonic() - killed_at:.1f}s")
        assert failed.state is JobState.NODE_FAIL, failed
        assert failed.failed_nodes == (victim,)
        assert failed.state.attempt_state is AttemptState.NODE_FAIL
        # a start while a host is down (the soak brings slurmctld back after a node death):
        # it waits for the live nodes, not for the frozen one
        again = devcluster("start", "--nodes", str(len(nodes)), "--no-prometheus",
                           cluster_dir=cluster_dir)  # fmt: skip
        assert again.returncode == 0, again.stderr
        remedy = watchdog_remedy(failed, spec, latest(ckpt))
        assert remedy.kind is RemedyKind.EXCLUDE_NODE and remedy.exclude_nodes == (victim,)
        resume_from = latest(ckpt)
        assert resume_from >= 3
        retry = replace(plan, attempt=2, exclude=(victim,))
        assert victim in launcher.job_request(retry).exclude
        sub2 = launcher.submit(slurm, retry)
        done = wait_for(slurm, sub2.job_id, lambda s: s.state.terminal, timeout_s=90)
        logs = job_logs(slurm, sub2.job_id, plan.log_dir)
        assert done.state is JobState.COMPLETED, logs
        assert victim not in done.nodes and spares & set(done.nodes)
        assert start_steps(logs) == {resume_from}
        assert latest(ckpt) == 24
    finally:
        revived = devcluster("revive-node", victim, cluster_dir=cluster_dir)
        assert revived.returncode == 0, revived.stderr


def test_preemption_signal_checkpoints_next_step_and_resumes(slurm, tmp_path, toy_spec, toy_plan):
    spec = toy_spec("preempt", steps=20, interval=1000)
    with EndpointRegistry(worker_token="w-token", read_token="r-token") as sup:
        plan = toy_plan(tmp_path, spec, supervisor_url=sup.url, worker_token="w-token")
        sub = launcher.submit(slurm, plan)
        wait_until("both nodes registered", lambda: len(sup.for_run("preempt", 1)) == 2, 60)
        endpoints = sup.for_run("preempt", 1)
        assert set(endpoints) <= set(slurm.nodes())
        host, port = next(iter(endpoints.values())).values()

        wait_until("step 5", lambda: (scrape_step(host, port) or 0) >= 5, 60)
        step_at_signal = int(scrape_step(host, port) or 0)
        slurm.signal(sub.job_id, "USR2")
        signalled_at = time.monotonic()
        stopped = wait_for(slurm, sub.job_id, lambda s: s.state.terminal, timeout_s=60)
        print(f"USR2 → job ended with 75: {time.monotonic() - signalled_at:.1f}s")
    assert stopped.state is JobState.FAILED and stopped.exit_code == 75, stopped
    saved = latest(plan.checkpoint_dir)
    # checkpoint at the next step boundary: at most a step or two after the one we scraped
    assert step_at_signal <= saved <= step_at_signal + 3
    assert watchdog_remedy(stopped, spec, saved).kind is RemedyKind.REQUEUE
    # requeued as the watchdog does it: the trainer resumes from the newest checkpoint
    sub2 = launcher.submit(slurm, replace(plan, attempt=2, resume_step=None))
    done = wait_for(slurm, sub2.job_id, lambda s: s.state.terminal, timeout_s=90)
    logs = job_logs(slurm, sub2.job_id, plan.log_dir)
    assert done.state is JobState.COMPLETED, logs
    # steps lost = steps since the signal that were not in the checkpoint: none
    assert start_steps(logs) == {saved}
    assert latest(plan.checkpoint_dir) == 20


def test_scontrol_requeue_restarts_the_same_job_from_its_checkpoint(
    slurm, tmp_path, toy_spec, toy_plan
):
    spec = toy_spec("requeue", steps=20, interval=2)
    plan = toy_plan(tmp_path, spec, requeue=True)
    sub = launcher.submit(slurm, plan)
    wait_until("a checkpoint", lambda: latest(plan.checkpoint_dir) >= 4, 60)
    slurm.requeue(sub.job_id)
    requeued_at = time.monotonic()
    wait_until(
        "the restart", lambda: len(start_steps(job_logs(slurm, sub.job_id, plan.log_dir))) == 2, 90
    )
    print(f"scontrol requeue → training restarted: {time.monotonic() - requeued_at:.1f}s")
    done = wait_for(slurm, sub.job_id, lambda s: s.state.terminal, timeout_s=120)
    logs = job_logs(slurm, sub.job_id, plan.log_dir)
    assert done.state is JobState.COMPLETED, logs
    starts = start_steps(logs)
    assert 0 in starts and len(starts) == 2 and max(starts) >= 4, starts
    assert latest(plan.checkpoint_dir) == 20
