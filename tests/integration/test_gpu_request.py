"""Issue 22, acceptance 1: a GPU spec's job asks SLURM for its GPUs; on nodes whose `gpu`
gres has no device behind it (the CPU dev cluster) the trainer stops with the no-GPU exit
code, and the watchdog escalates once instead of retrying the same request."""

from __future__ import annotations

import subprocess

import pytest
from sqlalchemy import select

from contracts import exitcodes
from contracts.paths import attempt_log_dir
from supervisor.models import Incident

from .conftest import Stack, tiny_spec

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_gpu_spec_asks_for_gpus_and_stops_without_retrying(stack: Stack) -> None:
    spec = tiny_spec(
        "it-gpu-request",
        stack.data,
        resources={"device": "gpu", "nodes": 1, "gpus_per_node": 2, "time_limit_minutes": 10},
        parallelism={"tensor": 1, "pipeline": 1, "data": 2, "distributed_optimizer": False},
    )
    run_id = stack.api("POST", "/v1/runs", spec)["id"]
    run = stack.wait_run(run_id, timeout_s=180)

    assert run["state"] == "needs_attention", run
    (attempt,) = run["attempts"]  # escalated on the first failure: no retry loop
    job_id = attempt["job_id"]
    shown = subprocess.run(
        ["scontrol", "show", "job", job_id], env=stack.slurm.env, capture_output=True,
        text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert "gres/gpu=2" in shown or "gres:gpu:2" in shown, shown
    status = stack.slurm.poll([job_id])[job_id]
    assert status.exit_code == exitcodes.NO_GPU, status

    db = stack.db()
    try:
        with db.session() as s:
            kinds = s.scalars(select(Incident.kind).where(Incident.run_id == run_id)).all()
    finally:
        db.dispose()
    assert kinds == ["job_no_gpu"], kinds
    events = stack.api("GET", f"/v1/runs/{run_id}/events?limit=1000")["items"]
    messages = " | ".join(e["message"] for e in events)
    assert "GPU job without GPUs" in messages, messages
    logs = stack.slurm.log_files(job_id, attempt_log_dir(stack.home, run_id, 1))
    log = "".join(p.read_text(errors="replace") for p in logs)
    assert "no GPU: node n" in log and "sees 0 of the 2 GPUs" in log, log[-2000:]
