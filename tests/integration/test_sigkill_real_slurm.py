"""SIGKILL the supervisor at random points during remedies against a REAL SLURM cluster.

The stand-in trials (tests/watchdog/test_watchdog_sigkill.py) prove the invariants against a
file-backed fake; here every sbatch, squeue, sacct, scancel and `find_jobs` (the lookup that
keeps a submission interrupted by a kill from being repeated) is the real `SlurmCluster` on a
local cluster of 3 nodes. Only the job itself is scripted (sigkill_trials.ScriptedJob): it
sleeps ~1 s and exits 75 (a checkpointed preemption → requeue), 1 once (attempt 3 → restart),
and 0 at the last attempt after writing the target checkpoint.

A remedy takes ~0.15 s between jobs of ~2 s, so a kill at a uniformly random time would rarely
hit one: the supervisor is (re)started once its current job has ended, when its first ticks
have a remedy to carry out, and killed at a random moment of the next `KILL_WINDOW_S`. After
the last kill a supervisor runs the rest of the attempts; then SLURM must hold exactly one job
per attempt name, the one its attempt recorded (sigkill_trials.check_invariants for the rest).

`NIGHTWATCH_SIGKILL_RUNS` runs × `KILLS_PER_RUN` kills (default 4 × 5 = 20, ~2 min on two shared
cores), kill times drawn from `NIGHTWATCH_SIGKILL_SEED`; the cluster has its own directory and
ports (`NIGHTWATCH_SIGKILL_CLUSTER_DIR`, `NIGHTWATCH_SIGKILL_BASE_PORT`).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from supervisor import store
from supervisor.db import Database
from supervisor.launcher import job_name
from supervisor.models import Attempt
from supervisor.slurm import JobState, SlurmCluster, detect_slurm

from .conftest import DEVCLUSTER, REPO

sys.path.insert(0, str(REPO / "tests" / "watchdog"))  # where sigkill_supervisor.py imports it
from sigkill_trials import (
    check_cancelled,
    check_invariants,
    finish,
    kill_trials,
    new_run,
    spawn,
    unfinished_actions,
    uniform_delay,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CLUSTER_DIR = Path(os.environ.get("NIGHTWATCH_SIGKILL_CLUSTER_DIR", "/tmp/nw-sigkill-cluster"))
BASE_PORT = os.environ.get("NIGHTWATCH_SIGKILL_BASE_PORT", "18900")
RUNS = int(os.environ.get("NIGHTWATCH_SIGKILL_RUNS", "4"))
SEED = int(os.environ.get("NIGHTWATCH_SIGKILL_SEED", "2000"))  # kill times: SEED + trial
KILLS_PER_RUN = 5
ATTEMPTS = 8  # 7 remedies; a kill cycle carries out at most one, so the last kill lands in time
KILL_WINDOW_S = 0.3  # a remedy runs ~0.05–0.2 s after the supervisor is ready


def _devcluster(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(DEVCLUSTER), "--dir", str(CLUSTER_DIR), "--base-port", BASE_PORT]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def slurm_conf() -> Iterator[Path]:
    """A cluster of this module's own (stopped at the end unless it was already up)."""
    if shutil.which("slurmctld") is None:
        pytest.skip("slurm-wlm is not installed (make system-packages)")
    conf = CLUSTER_DIR / "etc" / "slurm.conf"
    already = conf.exists() and detect_slurm(conf)  # `status` also wants Prometheus
    started = _devcluster("start", "--nodes", "3", "--no-prometheus")
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        yield conf
    finally:
        if not already:
            _devcluster("stop")


@pytest.fixture
def workdir() -> Iterator[Path]:
    """Not under pytest's basetemp: other pytest sessions on this host rotate those away."""
    path = Path(tempfile.mkdtemp(prefix="nw-sigkill-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _until_remedy_due(db: Database, slurm: SlurmCluster, run_id: str) -> Callable[[], None]:
    """Wait until the supervisor has a remedy to carry out: its current job has ended, an
    action is unfinished, or no job is recorded (a first or interrupted submission)."""

    def wait() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with db.session() as s:
                run = store.get_run(s, run_id)
                attempt = s.scalar(
                    select(Attempt).where(
                        Attempt.run_id == run_id, Attempt.number == run.current_attempt
                    )
                )
            if run.state.terminal or attempt is None or not attempt.job_id:
                return
            if unfinished_actions(db):
                return
            state = slurm.poll([attempt.job_id])[attempt.job_id].state
            if state.terminal and state is not JobState.UNKNOWN:
                return
            time.sleep(0.1)
        raise AssertionError(f"attempt {run.current_attempt} of {run_id} did not end in 60 s")

    return wait


def _jobs_of(slurm: SlurmCluster, run_id: str, attempts: int) -> dict[str, list[str]]:
    """SLURM's job ids per job name of this run, from squeue and sacct (every name starting
    with the run's prefix), each checked against `find_jobs`, the reconciler's lookup."""
    prefix = f"nw-{run_id}-a"
    listings = (
        ["squeue", "-h", "-t", "all", "-o", "%i|%j"],
        ["sacct", "-X", "-P", "-n", "-S", "now-1hours", "-o", "JobIDRaw,JobName"],
    )
    listed: dict[str, set[str]] = defaultdict(set)
    for cmd in listings:
        out = subprocess.run(cmd, env=slurm.env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        for line in out.stdout.splitlines():
            job_id, _, name = line.strip().partition("|")
            if name.startswith(prefix):
                listed[name].add(job_id)
    names = {*listed, *(job_name(run_id, n) for n in range(1, attempts + 1))}
    jobs = {name: slurm.find_jobs(name) for name in names}
    for name, ids in listed.items():
        assert set(jobs[name]) == ids, (name, jobs[name], ids)
    every = [j for ids in jobs.values() for j in ids]
    left = {j: s.state for j, s in slurm.poll(every).items() if not s.state.terminal}
    assert not left, left  # no job of the run still queued or running
    return jobs


def _cancel_all(slurm: SlurmCluster) -> None:
    """Nothing of a failed trial may hold the nodes for the next one (this cluster is ours)."""
    cmd = ["scancel", "--full", "--user", str(os.getuid())]
    subprocess.run(cmd, env=slurm.env, capture_output=True, timeout=30)


def _args(slurm_conf: Path, attempts: int) -> list[str]:
    return ["--slurm-conf", str(slurm_conf), "--attempts", str(attempts), "--tick", "0.1"]


@pytest.mark.parametrize("trial", range(RUNS))
def test_sigkill_during_remedies_on_real_slurm(slurm_conf: Path, workdir: Path, trial: int) -> None:
    started = time.monotonic()
    rng = random.Random(SEED + trial)
    slurm = SlurmCluster(slurm_conf)
    db, db_url, run_id = new_run(workdir)
    args, home = _args(slurm_conf, ATTEMPTS), workdir / "home"
    try:
        tally = kill_trials(
            db,
            db_url,
            home,
            args,
            kills=KILLS_PER_RUN,
            delay=uniform_delay(rng, KILL_WINDOW_S),
            before_start=_until_remedy_due(db, slurm, run_id),
        )
        finish(db_url, home, args, timeout_s=120)
        assert tally.kills == KILLS_PER_RUN  # every kill landed while remedies were left
        print(f"\n{tally} (run {run_id}, {time.monotonic() - started:.0f} s)")
        check_invariants(db, run_id, ATTEMPTS, _jobs_of(slurm, run_id, ATTEMPTS))
    finally:
        _cancel_all(slurm)
        db.dispose()


def test_sigkill_between_sbatch_and_the_pickle_on_real_slurm(
    slurm_conf: Path, workdir: Path
) -> None:
    """The narrowest window of a submission, hit on purpose: sbatch accepted the job, submitit
    had not yet moved its pickle into the job's folder. The restarted supervisor must adopt
    that job (not submit a second) and hand it its task before the job gives up waiting
    (60 s, then it fails like a program error and the run needs attention)."""
    slurm = SlurmCluster(slurm_conf)
    db, db_url, run_id = new_run(workdir)
    args, home = _args(slurm_conf, 2), workdir / "home"
    try:
        dying = spawn(db_url, home, [*args, "--die-after-sbatch"])
        assert dying.wait(timeout=60) == -signal.SIGKILL
        assert unfinished_actions(db)  # the submission's intent, without its outcome
        started = time.monotonic()
        finish(db_url, home, args, timeout_s=120)
        check_invariants(db, run_id, 2, _jobs_of(slurm, run_id, 2))
        assert time.monotonic() - started < 50  # the adopted job ran its task at once
    finally:
        _cancel_all(slurm)
        db.dispose()


def test_sigkill_after_sbatch_then_cancel_while_down_on_real_slurm(
    slurm_conf: Path, workdir: Path
) -> None:
    """Killed between sbatch and recording the job id, the run is cancelled while no
    supervisor runs: the next one cancels the run (still `pending`, its first submission cut
    off) and the orphan job SLURM holds under the run's name (found with `live_jobs`)."""
    slurm = SlurmCluster(slurm_conf)
    db, db_url, run_id = new_run(workdir)
    args, home = _args(slurm_conf, 2), workdir / "home"
    prefix = f"nw-{run_id}-"
    try:
        dying = spawn(db_url, home, [*args, "--die-after-sbatch"])
        assert dying.wait(timeout=60) == -signal.SIGKILL
        assert [j.name for j in slurm.live_jobs(prefix).values()] == [job_name(run_id, 1)]
        with db.write_session() as s:
            store.request_cancel(s, run_id)
        finish(db_url, home, args, timeout_s=120)
        check_cancelled(db, run_id, list(slurm.live_jobs(prefix)))
    finally:
        _cancel_all(slurm)
        db.dispose()
