"""A supervisor process for the SIGKILL trials: the real reconciler, store and actuator over
SQLite, with a SLURM stand-in whose state lives in a file (so it outlives the supervisor).

The stand-in makes every attempt end badly until attempt `--attempts`: attempt 3 FAILS
(restart), the others are PREEMPTED or hit their TIMEOUT (requeue), the last COMPLETES after
writing a checkpoint at the target step. Each submit/cancel sleeps a little, so kills land
inside remedies.

    python sigkill_supervisor.py DB_URL HOME STATE_FILE --attempts N
"""

from __future__ import annotations

import argparse
import fcntl
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from supervisor.db import Database
from supervisor.models import RunState
from supervisor.slurm import JobRequest, JobState, JobStatus, NodeInfo, Submission
from supervisor.watchdog.reconciler import Reconciler, WatchdogConfig
from supervisor.watchdog.snapshot import MetricsView, SourceHealth

OP_DELAY_S = 0.01


class FileCluster:
    kind = "slurm"

    def __init__(self, path: Path, home: Path, attempts: int, target: int) -> None:
        self.path, self.home, self.attempts, self.target = path, home, attempts, target

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
            run_id, _, attempt = request.job_name.removeprefix("nw-").rpartition("-a")
            st["jobs"][job_id] = {
                "name": request.job_name,
                "run_id": run_id,
                "attempt": int(attempt),
                "state": "PENDING",
                "polls": 0,
            }
        time.sleep(OP_DELAY_S)
        return Submission(job_id=job_id, log_dir=request.log_dir / job_id)

    def find_jobs(self, job_name: str) -> list[str]:
        with self._state() as st:
            return [j for j, v in st["jobs"].items() if v["name"] == job_name]

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
        if job["attempt"] >= self.attempts:
            from megatron_runs.checkpointing import step_dir, write_meta

            ckpt = step_dir(self.home / "runs" / job["run_id"] / "checkpoints", self.target)
            ckpt.mkdir(parents=True, exist_ok=True)
            (ckpt / "model.bin").write_bytes(b"x" * 8)
            write_meta(ckpt, self.target, self.target * 8, 2.0, {"data": 1})
            return "COMPLETED"
        if job["attempt"] == 3:
            return "FAILED"  # one crash: restart (a second would make the policy suspect n1)
        return "PREEMPTED" if job["attempt"] % 2 else "TIMEOUT"

    def cancel(self, job_id: str) -> None:
        time.sleep(OP_DELAY_S)
        with self._state() as st:
            st["jobs"][job_id]["state"] = "CANCELLED"

    def requeue(self, job_id: str) -> None: ...
    def signal(self, job_id: str, sig: str = "USR2") -> None: ...
    def drain(self, node: str, reason: str) -> None: ...
    def resume_node(self, node: str) -> None: ...

    def nodes(self) -> dict[str, NodeInfo]:
        return {"n1": NodeInfo("n1", "idle")}

    def log_files(self, job_id: str, log_dir: Path | None = None) -> list[Path]:
        return []


class NoMetrics:
    """No worker runs in the trials; MISSING metrics convict nothing."""

    name = "scrape"

    def collect(self, keys: Sequence[tuple[str, int]], now: float) -> dict:
        return {k: MetricsView(SourceHealth.MISSING) for k in keys}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("db_url")
    parser.add_argument("home", type=Path)
    parser.add_argument("state", type=Path)
    parser.add_argument("--attempts", type=int, default=6)
    parser.add_argument("--target", type=int, default=100)
    args = parser.parse_args()
    db = Database(args.db_url)
    cluster = FileCluster(args.state, args.home, args.attempts, args.target)
    config = WatchdogConfig(home=args.home, tick_seconds=0.01, lease_ttl_s=0.5)
    rec = Reconciler(db, cluster, NoMetrics(), config)
    print("ready", flush=True)
    while True:
        rec.tick()
        with db.session() as s:
            from supervisor import store

            runs = store.list_runs(s).items
        if runs and all(r.state.terminal or r.state is RunState.NEEDS_ATTENTION for r in runs):
            return 0
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main())
