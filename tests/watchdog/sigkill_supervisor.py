"""A supervisor process for the SIGKILL trials: the real reconciler, store and actuator over
SQLite, against a SLURM that outlives the supervisor: a stand-in whose state lives in a file, or
a real cluster whose jobs run a scripted stand-in of the trainer (sigkill_trials.ScriptedJob).

It exits once every run has ended or needs a person, no action is half done and every
notification was delivered (`--webhook`). `--die-after-sbatch` and `--die-after-escalation`
make it SIGKILL itself in the narrowest window of a submission or an escalation.

Either way every attempt ends badly until attempt `--attempts` (sigkill_trials.scripted_ending):
attempt 3 FAILS (restart), the others are preempted or hit their walltime (requeue), the last
COMPLETES after writing a checkpoint at the target step. The stand-in's submit/cancel sleep a
little, so kills land inside remedies.

    python sigkill_supervisor.py DB_URL HOME (--state STATE_FILE | --slurm-conf CONF) --attempts N
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import submitit
from sigkill_trials import (
    ScriptedSlurmCluster,
    parse_job_name,
    scripted_ending,
    write_target_checkpoint,
)
from sqlalchemy import select

from supervisor import store
from supervisor.db import Database
from supervisor.metrics_in import MetricsView, SourceHealth
from supervisor.models import Action, ActionState, RunState
from supervisor.slurm import (
    JobRequest,
    JobState,
    JobStatus,
    LiveJob,
    NodeInfo,
    NodeState,
    Submission,
)
from supervisor.watchdog import outbox
from supervisor.watchdog.notify import Notifier
from supervisor.watchdog.reconciler import Reconciler, WatchdogConfig

OP_DELAY_S = 0.01


class FileCluster:
    kind = "slurm"

    def __init__(
        self, path: Path, home: Path, attempts: int, target: int, crash_always: bool = False
    ) -> None:
        self.path, self.home, self.attempts, self.target = path, home, attempts, target
        self.crash_always = crash_always

    @contextmanager
    def _state(self) -> Iterator[dict[str, Any]]:
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = json.loads(self.path.read_text()) if self.path.exists() else {"jobs": {}}
            yield state
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(self.path)

    def submit(self, request: JobRequest, fn: Callable[[], object]) -> Submission:
        time.sleep(OP_DELAY_S)
        with self._state() as st:
            job_id = str(1000 + len(st["jobs"]))
            run_id, attempt = parse_job_name(request.job_name)
            st["jobs"][job_id] = {
                "name": request.job_name,
                "run_id": run_id,
                "attempt": attempt,
                "state": "PENDING",
                "polls": 0,
            }
        time.sleep(OP_DELAY_S)
        return Submission(job_id=job_id, log_dir=request.log_dir / job_id)

    def find_jobs(self, job_name: str) -> list[str]:
        with self._state() as st:
            return [j for j, v in st["jobs"].items() if v["name"] == job_name]

    def finish_submission(self, job_id: str, log_dir: Path) -> bool:
        return False

    def live_jobs(self, prefix: str) -> dict[str, LiveJob]:
        with self._state() as st:
            return {
                j: LiveJob(v["name"])
                for j, v in st["jobs"].items()
                if v["name"].startswith(prefix) and v["state"] in ("PENDING", "RUNNING")
            }

    def poll(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        out = {}
        with self._state() as st:
            for j in job_ids:
                job = st["jobs"].get(j)
                if job is None:
                    out[j] = JobStatus(j, JobState.UNKNOWN)
                    continue
                job["polls"] += 1
                if job["state"] == "PENDING" and job["polls"] >= 2:
                    job["state"] = "RUNNING"
                elif job["state"] == "RUNNING" and job["polls"] >= 3:
                    job["state"] = self._end(job)
                code = 1 if job["state"] == "FAILED" else 0
                out[j] = JobStatus(j, JobState(job["state"]), ("n1",), exit_code=code)
        return out

    def _end(self, job: dict[str, Any]) -> str:
        if self.crash_always:
            return JobState.FAILED.value
        ending = scripted_ending(job["attempt"], self.attempts)
        if ending is JobState.COMPLETED:
            write_target_checkpoint(self.home, job["run_id"], self.target)
        return ending.value

    def cancel(self, job_id: str) -> None:
        time.sleep(OP_DELAY_S)
        with self._state() as st:
            st["jobs"][job_id]["state"] = "CANCELLED"

    def requeue(self, job_id: str) -> None: ...
    def signal(self, job_id: str, sig: str = "USR2") -> None: ...
    def drain(self, node: str, reason: str) -> None: ...
    def resume_node(self, node: str) -> None: ...

    def nodes(self) -> dict[str, NodeInfo]:
        return {"n1": NodeInfo("n1", NodeState.IDLE)}

    def log_files(self, job_id: str, log_dir: Path | None = None) -> list[Path]:
        return []


class NoMetrics:
    """No worker runs in the trials; MISSING metrics convict nothing."""

    name = "scrape"

    def collect(
        self, keys: Sequence[tuple[str, int]], now: float, probe: Collection[tuple[str, int]] = ()
    ) -> dict:
        return {k: MetricsView(SourceHealth.MISSING) for k in keys}


def die_after_sbatch() -> None:
    """SIGKILL this process right after sbatch accepted a job, before submitit moves the job's
    pickle into its folder: the narrowest window of a submission, hit on purpose."""
    move = submitit.core.utils.JobPaths.move_temporary_file

    def die(self: Any, tmp: Path, name: str, keep_as_symlink: bool = False) -> None:
        if name == "submitted_pickle":
            os.kill(os.getpid(), signal.SIGKILL)
        move(self, tmp, name, keep_as_symlink)

    submitit.core.utils.JobPaths.move_temporary_file = die  # type: ignore[method-assign]


def die_after_escalation() -> None:
    """SIGKILL this process right after an escalation's state change (and its outbox message)
    committed, before the action's outcome is recorded or the webhook is posted."""
    transition = store.transition_run

    def die(session: Any, run_id: str, new: RunState, **kw: Any) -> bool:
        moved = transition(session, run_id, new, **kw)
        if moved and new is RunState.NEEDS_ATTENTION:
            os.kill(os.getpid(), signal.SIGKILL)
        return moved

    store.transition_run = die  # type: ignore[assignment]


def settled(db: Database) -> bool:
    """Every run ended or needs a person, with no action left half done."""
    with db.session() as s:
        runs = store.list_runs(s).items
        intents = s.scalars(select(Action.key).where(Action.state == ActionState.INTENT)).all()
    done = all(r.state.terminal or r.state is RunState.NEEDS_ATTENTION for r in runs)
    return bool(runs) and done and not intents


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("db_url")
    parser.add_argument("home", type=Path)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--state", type=Path, help="the stand-in's state file")
    where.add_argument("--slurm-conf", type=Path, help="a real cluster")
    parser.add_argument("--attempts", type=int, default=6)
    parser.add_argument("--target", type=int, default=100)
    parser.add_argument("--job-seconds", type=float, default=1.0, help="real jobs' sleep")
    parser.add_argument("--tick", type=float, default=0.01, help="pause between ticks")
    parser.add_argument("--die-after-sbatch", action="store_true")
    parser.add_argument("--die-after-escalation", action="store_true")
    parser.add_argument("--crash-always", action="store_true", help="every job FAILS (stand-in)")
    parser.add_argument("--webhook", help="where notifications are posted")
    args = parser.parse_args()
    if args.die_after_sbatch:
        die_after_sbatch()
    if args.die_after_escalation:
        die_after_escalation()
    db = Database(args.db_url)
    cluster: FileCluster | ScriptedSlurmCluster
    if args.state is not None:
        cluster = FileCluster(
            args.state, args.home, args.attempts, args.target, crash_always=args.crash_always
        )
    else:
        cluster = ScriptedSlurmCluster(
            args.slurm_conf, args.home, args.attempts, args.target, args.job_seconds
        )
    config = WatchdogConfig(home=args.home, tick_seconds=args.tick, lease_ttl_s=0.5)
    notifier = Notifier(args.webhook, db, poll_s=0.1)
    rec = Reconciler(db, cluster, NoMetrics(), config, notifier=notifier)
    print("ready", flush=True)
    while True:
        if rec.tick().leader and settled(db):
            with db.session() as s:
                if outbox.undelivered(s) == 0:
                    return 0
            notifier.flush(1)
        time.sleep(args.tick)


if __name__ == "__main__":
    sys.exit(main())
