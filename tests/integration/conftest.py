"""The real stack for the integration tests: a local SLURM cluster of 3 nodes with Prometheus
(`scripts/devcluster`, own directory and ports), the tiny demo corpus, and `nightwatch serve`
(API + reconciler, SQLite, executor slurm, Prometheus source) as a separate process.

Prometheus discovers the workers through the supervisor's `/v1/prometheus/targets`, so the
watchdog sees exactly what an operator's Prometheus would. Everything binds to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor.db import Database
from supervisor.slurm import SlurmCluster
from worker.local_launch import free_port

REPO = Path(__file__).resolve().parents[2]
DEVCLUSTER = REPO / "scripts" / "devcluster"
NIGHTWATCH = [sys.executable, "-m", "supervisor.cli"]
# Own cluster directory and ports: other developers' clusters on this host keep theirs.
CLUSTER_DIR = Path(os.environ.get("NIGHTWATCH_IT_CLUSTER_DIR", "/tmp/nightwatch-it-cluster"))
BASE_PORT = int(os.environ.get("NIGHTWATCH_IT_BASE_PORT", "18600"))
TERMINAL = {"succeeded", "failed", "cancelled", "needs_attention"}


def _devcluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEVCLUSTER), "--dir", str(CLUSTER_DIR), "--base-port",
         str(BASE_PORT), *args],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def _nightwatch(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(
        [*NIGHTWATCH, *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@dataclass
class Stack:
    """Handles on the running stack, for the tests."""

    url: str
    token: str
    home: Path
    data: dict[str, str]
    slurm: SlurmCluster

    def api(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def db(self) -> Database:
        return Database(f"sqlite:///{self.home / 'nightwatch.db'}")

    def wait_run(self, run_id: str, timeout_s: float) -> dict[str, Any]:
        """Poll the API until the run ends (or fail with its last state and events)."""
        deadline = time.monotonic() + timeout_s
        run: dict[str, Any] = {}
        while time.monotonic() < deadline:
            run = self.api("GET", f"/v1/runs/{run_id}")
            if run["state"] in TERMINAL:
                return run
            time.sleep(1)
        events = self.api("GET", f"/v1/runs/{run_id}/events?limit=1000")["items"]
        raise AssertionError(
            f"run {run_id} still {run.get('state')} after {timeout_s}s; "
            f"events: {[(e['kind'], e['message']) for e in events][-20:]}"
        )


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    if shutil.which("slurmctld") is None or shutil.which("prometheus") is None:
        pytest.skip("slurm-wlm / prometheus are not installed (make system-packages)")
    # Not under pytest's basetemp: other pytest sessions on this host rotate those away.
    home = Path(tempfile.mkdtemp(prefix="nightwatch-it-"))
    try:
        yield from _stack(home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _stack(home: Path) -> Iterator[Stack]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "NIGHTWATCH_HOME": str(home), "PYTHONPATH": str(REPO)}
    # Tokens first (the schema is created on the way): Prometheus's SD needs a read token.
    token = _nightwatch(
        env, "token", "create", "--name", "it", "--scope", "admin", "--scope", "submit",
        "--scope", "read",
    ).strip()  # fmt: skip
    # The corpus is built while the cluster starts (both take a while).
    prepare = subprocess.Popen(
        [*NIGHTWATCH, "data", "prepare", "--out", str(home / "data")],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    already = _devcluster("status").returncode == 0
    started = _devcluster(
        "start", "--nodes", "3", "--gpus-per-node", "2", "--sd-url",
        f"{url}/v1/prometheus/targets", "--sd-token", token,
    )  # fmt: skip
    prepared, errors = prepare.communicate(timeout=300)
    assert prepare.returncode == 0, errors[-3000:]
    data = dict(line.split(": ", 1) for line in prepared.strip().splitlines())
    assert started.returncode == 0, started.stderr[-3000:]
    exports = dict(
        line.removeprefix("export ").split("=", 1)
        for line in started.stdout.splitlines()
        if line.startswith("export ")
    )
    env.update(
        SLURM_CONF=exports["SLURM_CONF"],
        NIGHTWATCH_PROMETHEUS_URL=exports["NIGHTWATCH_PROMETHEUS_URL"],
        NIGHTWATCH_PUBLIC_URL=url,
        NIGHTWATCH_PORT=str(port),
        NIGHTWATCH_EXECUTOR="slurm",
        NIGHTWATCH_TICK_SECONDS="1",
    )
    log = (home / "serve.log").open("wb")
    server = subprocess.Popen(
        [*NIGHTWATCH, "serve"], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    slurm = SlurmCluster(exports["SLURM_CONF"])
    stack = Stack(url, token, home, data, slurm)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, (home / "serve.log").read_text()[-3000:]
            try:
                stack.api("GET", "/v1/runs")
                break
            except (urllib.error.URLError, OSError):
                assert time.monotonic() < deadline, "nightwatch serve did not answer in 60 s"
                time.sleep(0.5)
        yield stack
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()
        _cancel_jobs(slurm)
        if not already:
            _devcluster("stop")


def _cancel_jobs(slurm: SlurmCluster) -> None:
    """Leave no job of this session behind (they would hold the nodes for the next one)."""
    subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=slurm.env,
                   capture_output=True, timeout=30)  # fmt: skip


def tiny_spec(name: str, data: dict[str, str], **sections: Any) -> dict[str, Any]:
    """A tiny CPU Megatron-Core GPT; `sections` replace or extend the defaults per test."""
    spec: dict[str, Any] = {
        "name": name,
        "model": {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "seq_length": 32,
            "vocab_size": 4096,
            "precision": "fp32",
        },
        "parallelism": {"tensor": 1, "pipeline": 1, "data": 2, "distributed_optimizer": False},
        "resources": {
            "device": "cpu",
            "nodes": 2,
            "gpus_per_node": 1,
            "cpus_per_task": 1,
            "time_limit_minutes": 10,
        },
        "training": {
            "train_steps": 30,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "lr": 1e-3,
            "min_lr": 1e-4,
            "lr_warmup_steps": 3,
        },
        "data": {"prefix": data["data.prefix"], "tokenizer": data["data.tokenizer"]},
        "checkpoint": {"interval_steps": 5, "keep_last": 10},
    }
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec
