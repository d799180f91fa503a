"""Issue 3, acceptance 1: a TP 2 × PP 2 spec submitted through `POST /v1/runs` trains to
completion on 2 SLURM nodes × 2 tasks under the real supervisor, and the DB/API record the
attempt, its job id and nodes, and the checkpoints."""

from __future__ import annotations

import stat
import time

import pytest
from sqlalchemy import select

from contracts.paths import attempt_log_dir
from supervisor.models import Checkpoint, Endpoint, Token
from supervisor.slurm import JobState

from .conftest import Stack, tiny_spec

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_tp2_pp2_run_through_the_api_succeeds_on_two_nodes(stack: Stack) -> None:
    spec = tiny_spec(
        "it-tp2pp2",
        stack.data,
        parallelism={"tensor": 2, "pipeline": 2, "data": 1},
        resources={"device": "cpu", "nodes": 2, "gpus_per_node": 2},
        training={"train_steps": 20, "global_batch_size": 2, "micro_batch_size": 1},
    )
    started = time.monotonic()
    run_id = stack.api("POST", "/v1/runs", spec)["id"]
    run = stack.wait_run(run_id, timeout_s=240)
    print(f"\nTP2xPP2 run {run_id}: {run['state']} in {time.monotonic() - started:.1f} s")
    assert run["state"] == "succeeded", run
    assert run["last_step"] == 20
    (attempt,) = run["attempts"]
    assert attempt["state"] == "completed" and attempt["job_id"]
    assert len(attempt["nodes"]) == 2 and set(attempt["nodes"]) <= {"n1", "n2", "n3"}
    # What the supervisor recorded is what SLURM says about the job.
    status = stack.slurm.poll([attempt["job_id"]])[attempt["job_id"]]
    assert status.state is JobState.COMPLETED
    assert sorted(status.nodes) == sorted(attempt["nodes"])
    db = stack.db()
    try:
        with db.session() as s:
            ckpts = s.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id)).all()
            endpoints = s.scalars(select(Endpoint).where(Endpoint.run_id == run_id)).all()
            worker_tokens = s.scalars(select(Token).where(Token.run_id == run_id)).all()
    finally:
        db.dispose()
    steps = sorted(c.step for c in ckpts if c.complete)
    assert steps[-1] == 20 and {5, 10, 15} & set(steps), steps
    assert all(c.loss is not None and c.consumed_samples == c.step * 2 for c in ckpts)
    # each node registered its endpoint with the run's worker token, revoked once it ended
    assert sorted(e.node for e in endpoints) == sorted(attempt["nodes"])
    assert [t.revoked for t in worker_tokens] == [True]
    # submitit's pickles carry the worker token: sbatch and the job kept the folder private
    log_dir = attempt_log_dir(stack.home, run_id, 1)
    files = [p for p in log_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".pkl" for p in files) and any(p.suffix == ".out" for p in files)
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    assert [p for p in files if stat.S_IMODE(p.stat().st_mode) & 0o077] == []
