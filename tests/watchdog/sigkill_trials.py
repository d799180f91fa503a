"""What the SIGKILL trials share, whichever SLURM they run against (the file-backed stand-in of
sigkill_supervisor.py or a real cluster, tests/integration/test_sigkill_real_slurm.py).

Why one module: the two trials must script the same attempts (so the same remedies run), kill
and restart the supervisor the same way and hold the result to the same invariants; only the
way SLURM is asked differs. The real cluster runs `ScriptedJob` in place of the trainer, so it
must stay importable by the job's interpreter (it is pickled by reference).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from watchdog_fakes import TINY_SPEC

from contracts import exitcodes
from contracts.spec import RunSpec
from supervisor import launcher, store
from supervisor.db import Database
from supervisor.launcher import job_name
from supervisor.models import Action, ActionState, Attempt, Event, EventKind, RunState
from supervisor.slurm import JobRequest, JobState, SlurmCluster, Submission

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPEC = {
    "name": "sigkill",
    "model": TINY_SPEC["model"],
    "resources": {
        "device": "cpu",
        "nodes": 1,
        "gpus_per_node": 1,
        "cpus_per_task": 1,
        "time_limit_minutes": 5,
    },
    "training": {"train_steps": 100, "global_batch_size": 8},
    "recovery": {"max_restarts": 100},
}
TARGET = SPEC["training"]["train_steps"]
#: The process exit code a real job ends with for each scripted ending. A walltime stop is
#: the trainer's USR2 checkpoint-and-exit too, so SLURM says FAILED 75 for both.
EXIT_CODES = {
    JobState.COMPLETED: 0,
    JobState.FAILED: 1,
    JobState.PREEMPTED: exitcodes.REQUEUE,
    JobState.TIMEOUT: exitcodes.REQUEUE,
}


def scripted_ending(attempt: int, attempts: int) -> JobState:
    """How attempt `attempt` of a trial run ends: badly until the last, which completes."""
    if attempt >= attempts:
        return JobState.COMPLETED
    if attempt == 3:
        return JobState.FAILED  # one crash: restart (a second would make the policy suspect n1)
    return JobState.PREEMPTED if attempt % 2 else JobState.TIMEOUT


def parse_job_name(name: str) -> tuple[str, int]:
    """`nw-<run id>-a<N>` (supervisor.launcher.job_name) → (run id, N)."""
    parsed = launcher.parse_job_name(name)
    assert parsed is not None, name
    return parsed


def write_target_checkpoint(home: Path, run_id: str, target: int) -> None:
    """The last attempt's checkpoint at the target step, where the reconciler looks for it."""
    from contracts.checkpoints import step_dir, write_meta

    ckpt = step_dir(home / "runs" / run_id / "checkpoints", target)
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "model.bin").write_bytes(b"x" * 8)
    write_meta(ckpt, target, target * 8, 2.0, {"data": 1})


@dataclass(frozen=True)
class ScriptedJob:
    """What a real SLURM job runs instead of the trainer: a short sleep, then its scripted end
    (exit 75 like a checkpointed preemption, 1 like a crash, 0 after the final checkpoint)."""

    run_id: str
    attempt: int
    attempts: int
    home: str
    target: int
    sleep_s: float = 1.0

    def __call__(self) -> None:
        time.sleep(self.sleep_s)
        ending = scripted_ending(self.attempt, self.attempts)
        if ending is JobState.COMPLETED:
            write_target_checkpoint(Path(self.home), self.run_id, self.target)
        if EXIT_CODES[ending]:
            sys.exit(EXIT_CODES[ending])  # SystemExit passes submitit's `except Exception`


class ScriptedSlurmCluster(SlurmCluster):
    """The real SlurmCluster (sbatch, squeue, sacct, scancel, find_jobs) whose jobs run a
    `ScriptedJob` instead of the training task they were submitted with."""

    def __init__(
        self, slurm_conf: str | Path, home: Path, attempts: int, target: int, sleep_s: float
    ) -> None:
        super().__init__(slurm_conf)
        self.home, self.attempts, self.target, self.sleep_s = home, attempts, target, sleep_s

    def submit(self, request: JobRequest, fn: Callable[[], object]) -> Submission:
        run_id, attempt = parse_job_name(request.job_name)
        job = ScriptedJob(run_id, attempt, self.attempts, str(self.home), self.target, self.sleep_s)
        return super().submit(request, job)


# ------------------------------------------------------------------ kill and restart
def new_run(folder: Path) -> tuple[Database, str, str]:
    """A migrated SQLite store in `folder` holding one pending trial run: (db, its URL, run id)."""
    db_url = f"sqlite:///{folder / 'nw.db'}"
    db = Database(db_url)
    db.upgrade()
    with db.write_session() as s:
        run, _ = store.create_run(s, RunSpec.model_validate(SPEC))
    return db, db_url, run.id


def spawn(db_url: str, home: Path, cluster_args: Sequence[str]) -> subprocess.Popen[str]:
    """Start sigkill_supervisor.py in its own process group; return once it is ready."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "sigkill_supervisor.py"), db_url, str(home), *cluster_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def unfinished_actions(db: Database) -> int:
    """Actions whose intent is written and outcome is not: a kill landed inside them."""
    with db.session() as s:
        return len(s.scalars(select(Action).where(Action.state == ActionState.INTENT)).all())


@dataclass
class KillTally:
    kills: int = 0
    mid_action: int = 0  # kills that left an action between its intent and its outcome

    def __str__(self) -> str:
        between = "between an action's intent and its outcome"
        return f"{self.kills} kills, {self.mid_action} of them {between}"


def kill_trials(
    db: Database,
    db_url: str,
    home: Path,
    cluster_args: Sequence[str],
    *,
    kills: int,
    delay: Callable[[], float],
    before_start: Callable[[], None] = lambda: None,
) -> KillTally:
    """Start the supervisor, SIGKILL its process group after `delay()` s, `kills` times (fewer
    when the run completes first: the caller asserts how many landed)."""
    tally = KillTally()
    while tally.kills < kills:
        before_start()
        proc = spawn(db_url, home, cluster_args)
        time.sleep(delay())
        if proc.poll() is not None:
            break  # the run completed before this kill: too few remedies left
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        tally.kills += 1
        tally.mid_action += bool(unfinished_actions(db))
    return tally


def finish(db_url: str, home: Path, cluster_args: Sequence[str], timeout_s: float) -> None:
    """A last supervisor, left alone until every run has ended."""
    final = spawn(db_url, home, cluster_args)
    try:
        assert final.wait(timeout=timeout_s) == 0
    finally:
        if final.poll() is None:
            os.killpg(final.pid, signal.SIGKILL)
            final.wait()


def uniform_delay(rng: random.Random, high_s: float) -> Callable[[], float]:
    return lambda: rng.uniform(0.0, high_s)


# ------------------------------------------------------------------ invariants
def check_invariants(
    db: Database, run_id: str, attempts: int, jobs: Mapping[str, Sequence[str]]
) -> None:
    """After every kill and restart: one SLURM job per attempt (`jobs`: SLURM's ids per job
    name of this run), attempts 1..N without gaps, each recording SLURM's id, every action
    finished once with one intent and one outcome event, and the run succeeded."""
    assert all(len(ids) == 1 for ids in jobs.values()), jobs  # no duplicate SLURM job
    names = {job_name(run_id, n) for n in range(1, attempts + 1)}
    assert set(jobs) == names, sorted(set(jobs) ^ names)
    with db.session() as s:
        assert store.get_run(s, run_id).state is RunState.SUCCEEDED
        rows = s.scalars(select(Attempt).where(Attempt.run_id == run_id)).all()
        assert sorted(a.number for a in rows) == list(range(1, attempts + 1))
        for a in rows:
            assert [a.job_id] == list(jobs[job_name(run_id, a.number)]), a.number
        actions = s.scalars(select(Action).where(Action.run_id == run_id)).all()
        assert actions and all(a.state is ActionState.DONE for a in actions)
        events = s.scalars(select(Event).where(Event.run_id == run_id)).all()
        said = Counter((e.kind, e.attempt, e.message) for e in events)
        for a in actions:  # exactly one intent and one outcome event, none lost or doubled
            what = f"{a.kind} {a.target}"
            assert said.pop((EventKind.ACTION_INTENT, a.attempt, what), 0) == 1, what
            assert said.pop((EventKind.ACTION_OUTCOME, a.attempt, f"{what}: done"), 0) == 1, what
        kinds = {EventKind.ACTION_INTENT, EventKind.ACTION_OUTCOME}
        assert not [k for k in said if k[0] in kinds], said  # no event without its action


def check_actions_closed(db: Database, run_id: str) -> list[Action]:
    """Every action of the run finished (done, or abandoned by a cancel), each with exactly
    one intent and one outcome event; returns them."""
    with db.session() as s:
        actions = s.scalars(select(Action).where(Action.run_id == run_id)).all()
        events = s.scalars(select(Event).where(Event.run_id == run_id)).all()
    assert actions and not [a.key for a in actions if a.state is ActionState.INTENT]
    said = Counter((e.kind, e.attempt, e.message) for e in events)
    for a in actions:
        what = f"{a.kind} {a.target}"
        outcome = f"{what}: {'done' if a.state is ActionState.DONE else 'failed'}"
        assert said.pop((EventKind.ACTION_INTENT, a.attempt, what), 0) == 1, what
        assert said.pop((EventKind.ACTION_OUTCOME, a.attempt, outcome), 0) == 1, what
    kinds = {EventKind.ACTION_INTENT, EventKind.ACTION_OUTCOME}
    assert not [k for k in said if k[0] in kinds], said
    return list(actions)


def check_cancelled(db: Database, run_id: str, live: Sequence[str]) -> None:
    """A cancel requested while the supervisor was down: the run is cancelled, SLURM holds
    no live job of it (`live`: its queued or running job ids), nothing is left half done,
    and only a cancel abandoned actions."""
    assert live == [], live
    with db.session() as s:
        assert store.get_run(s, run_id).state is RunState.CANCELLED
    actions = check_actions_closed(db, run_id)
    abandoned = [a for a in actions if a.state is not ActionState.DONE]
    reasons = ({"abandoned": "run cancelled"}, {"abandoned": "run ended"})
    assert all(a.result_json in reasons for a in abandoned), abandoned
