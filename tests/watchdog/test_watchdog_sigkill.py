"""SIGKILL the supervisor at random points during remedies, restart it, check the invariants.

Real: the reconciler process, SQLite store, actuator, policy. Stand-in: SLURM (a file-backed
cluster that outlives the supervisor; see sigkill_supervisor.py). Invariants after every kill
and restart: one SLURM job per attempt, attempts numbered without gaps, every action finished
exactly once, one intent and one outcome event per action, and the run completes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import select

from supervisor import store
from supervisor.db import Database
from supervisor.models import Action, ActionState, Attempt, Event, EventKind, RunState
from supervisor.spec import RunSpec

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPEC = {
    "name": "sigkill",
    "model": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
        "vocab_size": 256,
    },
    "training": {"train_steps": 100, "global_batch_size": 8},
    "recovery": {"max_restarts": 100},
}
ATTEMPTS = 12  # 11 remedies (requeues and one restart) before the run completes
KILLS_PER_RUN = 5
RUNS = 4  # 20 kills in all


def _spawn(db_url: str, home: Path, state: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "sigkill_supervisor.py"), db_url, str(home), str(state),
         "--attempts", str(ATTEMPTS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(RUNS))
def test_sigkill_during_remedies_leaves_no_duplicate_and_completes(
    tmp_path: Path, trial: int
) -> None:
    rng = random.Random(1000 + trial)
    db_url = f"sqlite:///{tmp_path / 'nw.db'}"
    db = Database(db_url)
    db.upgrade()
    with db.write_session() as s:
        run, _ = store.create_run(s, RunSpec.model_validate(SPEC))
    state = tmp_path / "slurm.json"
    kills = mid_action = 0
    while kills < KILLS_PER_RUN:
        proc = _spawn(db_url, tmp_path / "home", state)
        time.sleep(rng.uniform(0.0, 0.2))
        if proc.poll() is not None:
            break  # the run completed before this kill: too few remedies left
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        with db.session() as s:
            intents = s.scalars(select(Action).where(Action.state == ActionState.INTENT)).all()
            mid_action += bool(intents)
    final = _spawn(db_url, tmp_path / "home", state)
    try:
        assert final.wait(timeout=120) == 0
    finally:
        if final.poll() is None:
            os.killpg(final.pid, signal.SIGKILL)
            final.wait()
    assert kills == KILLS_PER_RUN  # every kill landed while remedies were still running
    print(f"\n{kills} kills, {mid_action} of them between an action's intent and its outcome")

    jobs = json.loads(state.read_text())["jobs"]
    names = Counter(j["name"] for j in jobs.values())
    assert all(n == 1 for n in names.values()), names  # no duplicate SLURM job
    with db.session() as s:
        assert store.get_run(s, run.id).state is RunState.SUCCEEDED
        attempts = s.scalars(select(Attempt).where(Attempt.run_id == run.id)).all()
        assert sorted(a.number for a in attempts) == list(range(1, ATTEMPTS + 1))
        by_name = {j["name"]: job_id for job_id, j in jobs.items()}
        for a in attempts:
            assert a.job_id == by_name[f"nw-{run.id}-a{a.number}"]
        actions = s.scalars(select(Action).where(Action.run_id == run.id)).all()
        assert actions and all(a.state is ActionState.DONE for a in actions)
        events = s.scalars(select(Event).where(Event.run_id == run.id)).all()
        intents = Counter(e.message for e in events if e.kind is EventKind.ACTION_INTENT)
        outcomes = Counter(e.message for e in events if e.kind is EventKind.ACTION_OUTCOME)
        assert sum(intents.values()) == len(actions) == sum(outcomes.values())
    db.dispose()
