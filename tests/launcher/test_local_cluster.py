"""The embedded default without SLURM: submitit's LocalExecutor behind the same interface."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import stat
from pathlib import Path

import psutil
import pytest

from supervisor import launcher
from supervisor.slurm import (
    JobRequest,
    JobState,
    LocalCluster,
    SlurmCluster,
    Unsupported,
    make_cluster,
    wait_for,
)
from supervisor.watchdog.snapshot import RemedyKind

from .cluster_helpers import job_logs, latest, wait_until, watchdog_remedy


def test_no_controller_means_local(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    assert isinstance(make_cluster(), LocalCluster)


def test_local_run_trains_and_stops_on_signal(tmp_path, toy_spec, toy_plan):
    cluster = LocalCluster()
    spec = toy_spec("local", steps=200, nodes=1, per_node=2, interval=1000)
    plan = toy_plan(tmp_path, spec)
    with pytest.raises(Unsupported):
        launcher.submit(cluster, toy_plan(tmp_path, toy_spec("two", steps=2)))
    sub = launcher.submit(cluster, plan)
    wait_until(
        "the ranks to start",
        lambda: "starts at step 0" in job_logs(cluster, sub.job_id, plan.log_dir),
        60,
    )
    assert cluster.poll([sub.job_id])[sub.job_id].state is JobState.RUNNING
    cluster.signal(sub.job_id)
    done = wait_for(cluster, sub.job_id, lambda s: s.state.terminal, timeout_s=60)
    logs = job_logs(cluster, sub.job_id, plan.log_dir)
    assert "toy: stop signal, checkpointed step" in logs, logs
    assert 0 < latest(plan.checkpoint_dir) < 200
    assert "rank 1/2" in logs
    assert done.state is JobState.FAILED and done.exit_code == 75, done
    assert watchdog_remedy(done, plan.spec, latest(plan.checkpoint_dir)).kind is RemedyKind.REQUEUE


def test_a_crashed_rank_ends_its_job_though_teardown_would_hang(tmp_path, toy_spec, toy_plan):
    """Rank 1 dies at step 3; rank 0's all-reduce fails and raises, with a thread alive that
    the interpreter's teardown would wait for forever. The task must leave anyway: a survivor
    that does not exit keeps the job RUNNING, and a crash looked like a hang (eleventh
    session)."""
    cluster = LocalCluster()
    spec = toy_spec("crash", steps=1000, nodes=1, per_node=2, interval=1000)
    plan = toy_plan(tmp_path, spec, toy_env={"TOY_CRASH_AT": "1:3", "TOY_LINGER": "1"})
    sub = launcher.submit(cluster, plan)
    try:
        done = wait_for(cluster, sub.job_id, lambda s: s.state.terminal, timeout_s=90)
    finally:
        cluster.cancel(sub.job_id)  # a failed test must not leave the lingering survivor
    logs = job_logs(cluster, sub.job_id, plan.log_dir)
    assert "toy: rank 1 crashes at step 3" in logs, logs
    assert "Traceback" in logs and "RuntimeError" in logs, logs  # rank 0's, for the blame
    assert done.state is JobState.FAILED, done


def test_configured_executor_wins_over_a_reachable_slurm_conf(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """NIGHTWATCH_EXECUTOR=local must not be overridden by a SLURM_CONF in the environment."""
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    assert isinstance(make_cluster(executor="local"), LocalCluster)
    assert isinstance(make_cluster(executor="slurm"), SlurmCluster)
    assert isinstance(make_cluster(executor="auto"), LocalCluster)  # no controller answers


def test_cancel_stops_tasks_that_ignore_sigint(tmp_path, toy_spec, toy_plan):
    """A supervisor started in the background by a shell has SIGINT ignored, and so has every
    process it starts: submitit's own cancel (a SIGINT) then stopped nothing, and the tasks
    trained on beside the next attempt. The cancel kills them."""
    cluster = LocalCluster()
    plan = toy_plan(tmp_path, toy_spec("bg", steps=100_000, nodes=1, per_node=2, interval=1000))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sub = launcher.submit(cluster, plan)
    finally:
        signal.signal(signal.SIGINT, previous)
    wait_until(
        "the ranks to start",
        lambda: "starts at step 0" in job_logs(cluster, sub.job_id, plan.log_dir),
        60,
    )
    controller = psutil.Process(cluster._jobs[sub.job_id][0]._process.pid)
    tasks = controller.children(recursive=True)
    try:
        assert len(tasks) >= 2
        cluster.cancel(sub.job_id)
        alive = [t for t in tasks if t.is_running() and t.status() != psutil.STATUS_ZOMBIE]
        assert alive == []
        assert cluster.poll([sub.job_id])[sub.job_id].state is JobState.CANCELLED
    finally:  # a failed cancel must not leave a 100,000-step job behind
        for proc in [*tasks, controller]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def test_the_submission_folder_is_private_to_the_supervisor(tmp_path):
    """submitit's pickles carry the job's environment, the worker token among it: the folder
    is 0700 (a folder that existed is tightened) and every file in it 0600, whatever the
    supervisor's umask; the umask is given back afterwards."""
    log_dir = tmp_path / "logs" / "r-1" / "a1"
    log_dir.mkdir(parents=True, mode=0o755)
    log_dir.chmod(0o755)
    request = JobRequest(job_name="private", log_dir=log_dir, nodes=1, tasks_per_node=1)
    cluster = LocalCluster()
    previous = os.umask(0o022)
    try:
        sub = cluster.submit(request, functools.partial(int, "0"))
        assert os.umask(0o022) == 0o022
    finally:
        os.umask(previous)
    wait_for(cluster, sub.job_id, lambda s: s.state.terminal, timeout_s=60)
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    made = list(log_dir.rglob("*"))
    assert any(p.suffix == ".pkl" for p in made), made
    for path in made:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_a_job_restarted_inside_ends_with_its_last_attempts_outcome(tmp_path, toy_spec, toy_plan):
    """The local executor reads a job's outcome from the exit codes in the job's folder: after
    a restart inside the job they must be the last attempt's, or a job whose last attempt
    finished reads as killed (`contracts.restart`)."""
    from contracts.restart import RestartOrder, job_control_dir, write_order

    cluster = LocalCluster()
    spec = toy_spec("local-injob", steps=12, nodes=1, per_node=2, interval=2)
    plan = toy_plan(tmp_path, spec, run_dir=tmp_path / "run")
    sub = launcher.submit(cluster, plan)
    wait_until("step 4 saved", lambda: latest(plan.checkpoint_dir) >= 4, 60)
    order = RestartOrder(attempt=2, log_dir=str(tmp_path / "logs-a2"), resume_step=2)
    write_order(job_control_dir(tmp_path / "run", sub.job_id), order)
    done = wait_for(cluster, sub.job_id, lambda s: s.state.terminal, timeout_s=60)
    assert done.state is JobState.COMPLETED and done.exit_code == 0, done
    assert latest(plan.checkpoint_dir) == 12
