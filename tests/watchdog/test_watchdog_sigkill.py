"""SIGKILL the supervisor at random points during remedies, restart it, check the invariants.

Real: the reconciler process, SQLite store, actuator, policy. Stand-in: SLURM (a file-backed
cluster that outlives the supervisor; see sigkill_supervisor.py). Invariants after every kill
and restart (sigkill_trials.check_invariants): one SLURM job per attempt, attempts numbered
without gaps, every action finished exactly once, one intent and one outcome event per action,
and the run completes. tests/integration/test_sigkill_real_slurm.py runs the same trials
against a real SLURM cluster.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

import pytest
from sigkill_trials import check_invariants, finish, kill_trials, new_run, uniform_delay

ATTEMPTS = 12  # 11 remedies (requeues and one restart) before the run completes
KILLS_PER_RUN = 5
RUNS = 4  # 20 kills in all


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(RUNS))
def test_sigkill_during_remedies_leaves_no_duplicate_and_completes(
    tmp_path: Path, trial: int
) -> None:
    rng = random.Random(1000 + trial)
    db, db_url, run_id = new_run(tmp_path)
    state = tmp_path / "slurm.json"
    args = ["--state", str(state), "--attempts", str(ATTEMPTS)]
    home = tmp_path / "home"
    tally = kill_trials(db, db_url, home, args, kills=KILLS_PER_RUN, delay=uniform_delay(rng, 0.2))
    finish(db_url, home, args, timeout_s=120)
    assert tally.kills == KILLS_PER_RUN  # every kill landed while remedies were still running
    print(f"\n{tally}")

    jobs: dict[str, list[str]] = defaultdict(list)
    for job_id, job in json.loads(state.read_text())["jobs"].items():
        jobs[job["name"]].append(job_id)
    check_invariants(db, run_id, ATTEMPTS, jobs)
    db.dispose()
