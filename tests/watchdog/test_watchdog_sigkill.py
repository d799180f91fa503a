"""SIGKILL the supervisor at random points during remedies, restart it, check the invariants;
also with a cancel requested while it is down, and with a kill inside an escalation.

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
import signal
from collections import defaultdict
from pathlib import Path

import pytest
from sigkill_trials import (
    check_actions_closed,
    check_cancelled,
    check_invariants,
    finish,
    kill_trials,
    new_run,
    spawn,
    uniform_delay,
)
from sqlalchemy import select
from watchdog_fakes import Hook

from supervisor import store
from supervisor.models import Action, ActionState, OutboxMessage, RunState
from supervisor.watchdog import outbox

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


def _live(state: Path, run_id: str) -> list[str]:
    """The run's queued or running jobs in the fake SLURM's state (none before its first
    write: every kill so far came before the supervisor submitted anything)."""
    if not state.exists():
        return []
    jobs = json.loads(state.read_text())["jobs"]
    return [j for j, v in jobs.items() if v["run_id"] == run_id and v["state"] in LIVE]


LIVE = ("PENDING", "RUNNING")


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(RUNS))
def test_sigkill_then_a_cancel_while_down_leaves_no_live_job(tmp_path: Path, trial: int) -> None:
    """Killed at random points during remedies; the run is cancelled while no supervisor
    runs; the next one cancels it, and every job of it that SLURM still runs."""
    rng = random.Random(3000 + trial)
    db, db_url, run_id = new_run(tmp_path)
    state = tmp_path / "slurm.json"
    args = ["--state", str(state), "--attempts", str(ATTEMPTS)]
    home = tmp_path / "home"
    delay = uniform_delay(rng, 0.2)
    tally = kill_trials(db, db_url, home, args, kills=3, delay=delay)
    for _ in range(20):  # until a kill leaves a job of the run queued or running
        if _live(state, run_id):
            break
        tally.kills += kill_trials(db, db_url, home, args, kills=1, delay=delay).kills
    assert _live(state, run_id)
    with db.write_session() as s:
        store.request_cancel(s, run_id)
    finish(db_url, home, args, timeout_s=120)
    print(f"\n{tally}")
    check_cancelled(db, run_id, _live(state, run_id))
    db.dispose()


@pytest.mark.slow
def test_sigkill_during_an_escalation_still_sends_the_webhook(tmp_path: Path) -> None:
    """Killed right after the escalation committed (before its outcome and its post): the
    next supervisor finishes the escalation and the webhook gets it, with its id."""
    hook = Hook()
    try:
        db, db_url, run_id = new_run(tmp_path)  # every job crashes on the only node: escalated
        state = tmp_path / "slurm.json"
        args = ["--state", str(state), "--crash-always", "--webhook", hook.url]
        home = tmp_path / "home"
        dying = spawn(db_url, home, [*args, "--die-after-escalation"])
        assert dying.wait(timeout=120) == -signal.SIGKILL
        with db.session() as s:
            assert store.get_run(s, run_id).state is RunState.NEEDS_ATTENTION
            (escalation,) = s.scalars(
                select(Action).where(Action.run_id == run_id, Action.kind == "escalate")
            ).all()
        assert escalation.state is ActionState.INTENT
        assert escalation.key not in {m["id"] for m in hook.received}
        finish(db_url, home, args, timeout_s=120)
        check_actions_closed(db, run_id)
        with db.session() as s:
            sent = {m.key for m in s.scalars(select(OutboxMessage)).all()}
            assert outbox.undelivered(s) == 0
        got = [m["id"] for m in hook.received]
        assert escalation.key in got and sent == set(got)  # at least once; duplicates allowed
        db.dispose()
    finally:
        hook.close()
