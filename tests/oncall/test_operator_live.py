"""The on-call engineer's surface against the real parts: `nightwatch serve` (API + reconciler,
SQLite, submitit's local executor, direct scrapes) as a subprocess, tiny CPU Megatron-Core
runs, and the real CLI.

One run (300 steps: long enough that the operator's rollback lands before it ends, however
loaded the machine) crashes once at step 25 with no restart budget, so it needs attention;
while it trained its progress and logs were visible; `nightwatch resume` brings it back from
its checkpoint, and `nightwatch rollback --to-step 30 --skip-samples 300:340` rewinds it. Its
final losses must equal, step for step, those of a clean run that skips the same samples
(exact resume). Another run hangs with no budget left: escalation cancels its job, freeing
what it held.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from oncall_live import free_port, wait_for

from supervisor import store
from supervisor.auth import Scope
from supervisor.db import Database
from supervisor.run_logs import loss_points
from worker.local_launch import launch

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
STEPS, SKIP = 300, (300, 340)


def tiny_spec(name: str, faults: list[dict[str, Any]]) -> dict[str, Any]:
    """One CPU process on the built-in demo corpus, a log line every step, no restart the
    operator did not ask for."""
    return {
        "name": name,
        "model": {
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "seq_length": 64,
            "vocab_size": 4096,
            "precision": "fp32",
        },
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 1, "distributed_optimizer": False},
        "resources": {"device": "cpu", "nodes": 1, "gpus_per_node": 1, "cpus_per_task": 1},
        "training": {
            "train_steps": STEPS,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "lr": 1e-3,
            "min_lr": 1e-4,
            "lr_warmup_steps": 5,
            "log_interval": 1,
        },
        "data": {},
        "checkpoint": {"interval_steps": 10, "keep_last": 20},
        "recovery": {"max_restarts": 0, "hang_floor_seconds": 5, "on_escalation": "cancel"},
        "faults": faults,
    }


class Live:
    def __init__(self, api: str, home: Path, token: str) -> None:
        self.api, self.home, self.token = api, home, token
        self.env = {**os.environ, "NIGHTWATCH_URL": api, "NIGHTWATCH_TOKEN": token}

    def get(self, run_id: str) -> dict[str, Any]:
        r = httpx.get(f"{self.api}/v1/runs/{run_id}", headers=self._auth, timeout=10)
        r.raise_for_status()
        return r.json()

    def submit(self, spec: dict[str, Any]) -> str:
        r = httpx.post(f"{self.api}/v1/runs", json=spec, headers=self._auth, timeout=10)
        r.raise_for_status()
        return str(r.json()["id"])

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor.cli", *args],
            env=self.env, capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip

    @property
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("operator")
    home = tmp / "home"
    home.mkdir()
    db = Database(f"sqlite:///{home / 'nightwatch.db'}")
    db.upgrade()
    with db.write_session() as s:
        token = store.create_token(s, "oncall", [Scope.ADMIN])[1]
    db.dispose()
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    env = {
        **os.environ, "NIGHTWATCH_HOME": str(home), "NIGHTWATCH_PORT": str(port),
        "NIGHTWATCH_PUBLIC_URL": api, "NIGHTWATCH_EXECUTOR": "local",
        "NIGHTWATCH_TICK_SECONDS": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
    }  # fmt: skip
    env.pop("NIGHTWATCH_PROMETHEUS_URL", None)
    env.pop("NIGHTWATCH_DATABASE_URL", None)
    with ExitStack() as stack:
        log = stack.enter_context((tmp / "supervisor.log").open("w"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "serve"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

        def stop() -> None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)

        stack.callback(stop)
        wait_for(lambda: httpx.get(f"{api}/healthz", timeout=2).status_code == 200, 60, "serve")
        yield Live(api, home, token)


def _final_losses(live: Live, run: dict[str, Any]) -> dict[int, float]:
    """step → loss of the run's final trajectory, from the trainer's own step lines."""
    attempts = [
        {"number": a["number"], "job_id": a["job_id"], "nodes": a["nodes"]} for a in run["attempts"]
    ]
    out: dict[int, float] = {}
    for p in sorted(loss_points(live.home, run["id"], attempts), key=lambda p: (p.attempt, p.t)):
        out[p.step] = p.loss  # a later attempt's step replaces the one it was rolled back from
    return out


def _clean_losses(spec: dict[str, Any], home: Path, work: Path) -> dict[int, float]:
    """The same run without faults or supervisor, skipping SKIP from the start."""
    path = work / "clean.yaml"
    path.write_text(yaml.safe_dump({**spec, "faults": [], "name": "clean"}))
    run = launch(
        ["--spec", str(path), "--checkpoint-dir", str(work / "ck"),
         "--skip", f"{SKIP[0]}:{SKIP[1]}"],
        1, work / "logs",
        env={"NIGHTWATCH_HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        python=sys.executable,
    )  # fmt: skip
    assert run.wait(timeout=300) == [0], run.logs
    return {e["step"]: float(e["loss"]) for e in run.events() if e["event"] == "step"}


def test_progress_logs_resume_and_an_operator_rollback_train_like_a_clean_run(
    live: Live, tmp_path: Path
) -> None:
    spec = tiny_spec("operator", [{"kind": "crash", "step": 25, "rank": 0}])
    run_id = live.submit(spec)

    # Progress while it trains, in the API and the CLI; its log, through the CLI.
    wait_for(lambda: (live.get(run_id).get("progress") or {}).get("step", 0) >= 5, 180, "steps")
    status = live.cli("status", run_id)
    assert status.returncode == 0 and "progress" in status.stdout, status.stdout
    logs = live.cli("logs", run_id, "--tail", "50")
    assert logs.returncode == 0 and '"event": "step"' in logs.stdout, logs.stdout[-2000:]

    # The crash at step 25 with no restart budget: a person must look.
    wait_for(lambda: live.get(run_id)["state"] == "needs_attention", 180, "needs_attention")
    resumed = live.cli("resume", run_id)
    assert resumed.returncode == 0, resumed.stderr
    wait_for(lambda: live.get(run_id)["current_attempt"] == 2, 60, "the resumed attempt")

    # Past step 40 of the resumed attempt, rewind to 30 and skip samples 300-340.
    def past_40() -> bool:
        run = live.get(run_id)
        return run["current_attempt"] == 2 and (run.get("progress") or {}).get("step", 0) >= 40

    wait_for(past_40, 180, "the resumed attempt past step 40")
    rolled = live.cli(
        "rollback", run_id, "--to-step", "30", "--skip-samples", f"{SKIP[0]}:{SKIP[1]}"
    )
    assert rolled.returncode == 0, rolled.stderr
    wait_for(lambda: live.get(run_id)["state"] == "succeeded", 300, "the run to succeed")

    run = live.get(run_id)
    third = run["attempts"][-1]
    assert run["current_attempt"] == 3 and third["resume_step"] == 30
    assert third["skip_ranges"] == [list(SKIP)]
    mine, clean = _final_losses(live, run), _clean_losses(spec, live.home, tmp_path)
    assert sorted(mine) == list(range(1, STEPS + 1))
    assert mine == clean  # bit for bit: exact resume, the same samples skipped


def test_an_escalated_hang_frees_its_job(live: Live) -> None:
    node = socket.gethostname()  # the local executor's one node
    faults = [{"kind": "node", "node": node, "effect": "hang", "after_step": 15}]
    run_id = live.submit(tiny_spec("hang", faults))
    wait_for(lambda: live.get(run_id)["state"] == "needs_attention", 300, "needs_attention")
    run = live.get(run_id)
    assert run["current_attempt"] == 1 and "no step for" in (run["state_reason"] or ""), run
    # recovery.on_escalation: cancel — the hung job does not hold its node until walltime.
    wait_for(
        lambda: live.get(run_id)["attempts"][-1]["state"] == "cancelled", 60, "the job cancelled"
    )
    events = json.loads(live.cli("events", run_id, "--json").stdout)["items"]
    assert any(e["kind"] == "action_outcome" and "escalate" in e["message"] for e in events)
