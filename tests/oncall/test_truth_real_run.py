"""The dashboard truth test against the real parts, in one shared scenario.

`nightwatch serve` (API + reconciler, SQLite, submitit's local executor, the Prometheus metrics
source) runs as a subprocess; a real Prometheus, started from the repository's prometheus.yml
and alerts.yml, scrapes it and discovers the workers through its `/v1/prometheus/targets` with a
real `read` token. A tiny CPU Megatron-Core run is submitted through the API with a poisoned
data window, so the watchdog detects a loss spike, rolls back and skips the window, and the run
trains on. While it does, every dashboard panel, variable, annotation and alert expression is
executed against that Prometheus: one that returns nothing fails. Then `nightwatch report`
(the real CLI, against the running supervisor) must tell the story in text and in a PNG.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from matplotlib.image import imread
from oncall_live import free_port, prometheus_config, start_prometheus, wait_for
from promql_truth import all_queries, failures, run_queries

from supervisor import store
from supervisor.auth import Scope
from supervisor.cli.demo import BATCH, demo_spec
from supervisor.db import Database
from supervisor.metrics_in import loss_history

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


#: Steps 401-460 are poisoned. One CPU process runs 10-30 steps a second depending on the
#: machine, and the watchdog first needs several scrapes (1 s) of healthy loss for a baseline:
#: a window at step 120 came before the baseline on a fast CI machine and went unseen. 60 steps
#: stay poisoned for at least two scrapes; the skip covers the whole window whatever step the
#: spike is detected at, so one rollback cures it.
POISON = (400 * BATCH, 460 * BATCH)


def scenario_spec() -> dict[str, Any]:
    """`nightwatch demo`'s poisoned run on one CPU process, long enough to outlive the test."""
    spec = demo_spec(100_000, "", "")
    spec.update(
        name="truth-run",
        data={},  # the built-in demo corpus, prepared by the trainer under NIGHTWATCH_HOME
        training={**spec["training"], "eval_interval": 0},  # no valid share held out here
        parallelism={"tensor": 1, "pipeline": 1, "data": 1, "distributed_optimizer": False},
        resources={"device": "cpu", "nodes": 1, "gpus_per_node": 1, "cpus_per_task": 1},
        checkpoint={"interval_steps": 10, "keep_last": 20},
        recovery={**spec["recovery"], "rollback_skip_steps": (POISON[1] - POISON[0]) // BATCH},
        faults=[{"kind": "poison_data", "start_sample": POISON[0], "end_sample": POISON[1]}],
    )
    return spec


@dataclass
class Scenario:
    tmp: Path
    api: str
    prometheus: str
    run_id: str
    cli_env: dict[str, str]

    def run(self) -> dict[str, Any]:
        return httpx.get(
            f"{self.api}/v1/runs/{self.run_id}", headers=self.headers, timeout=10
        ).json()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cli_env['NIGHTWATCH_TOKEN']}"}

    def value(self, expr: str) -> float | None:
        answer = httpx.get(
            f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10
        ).json()
        result = answer["data"]["result"]
        return float(result[0]["value"][1]) if result else None


def _stop_supervisor(proc: subprocess.Popen[bytes]) -> None:
    """TERM the server, then KILL whatever is left of its process group (local job tasks)."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _cancel(scenario: Scenario) -> None:
    """Cancel the run through the API; the supervisor then cancels its job."""
    httpx.post(
        f"{scenario.api}/v1/runs/{scenario.run_id}/cancel", headers=scenario.headers, timeout=10
    )
    wait_for(lambda: scenario.run()["state"] == "cancelled", 60, "the run to be cancelled")


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    tmp = tmp_path_factory.mktemp("real")
    home = tmp / "home"
    home.mkdir()
    db = Database(f"sqlite:///{home / 'nightwatch.db'}")
    db.upgrade()
    with db.write_session() as s:
        read = store.create_token(s, "prometheus", [Scope.READ])[1]
        submit = store.create_token(s, "oncall", [Scope.SUBMIT])[1]
    db.dispose()
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:
        token_file = tmp / "nightwatch_token"
        token_file.write_text(read + "\n")
        config = prometheus_config(f"{api}/v1/prometheus/targets", f"127.0.0.1:{port}", token_file)
        prometheus = start_prometheus(stack, tmp, config)
        env = {
            **os.environ, "NIGHTWATCH_HOME": str(home), "NIGHTWATCH_PORT": str(port),
            "NIGHTWATCH_PUBLIC_URL": api, "NIGHTWATCH_PROMETHEUS_URL": prometheus,
            "NIGHTWATCH_EXECUTOR": "local", "NIGHTWATCH_TICK_SECONDS": "1",
            "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            # the on-call token is `submit`; this server lets it inject the scenario's fault
            "NIGHTWATCH_ALLOW_FAULT_INJECTION": "true",
        }  # fmt: skip
        log = stack.enter_context((tmp / "supervisor.log").open("w"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "serve"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        stack.callback(_stop_supervisor, proc)
        wait_for(lambda: httpx.get(f"{api}/healthz", timeout=2).status_code == 200, 60, "serve")
        cli_env = {**os.environ, "NIGHTWATCH_URL": api, "NIGHTWATCH_TOKEN": submit}
        created = httpx.post(
            f"{api}/v1/runs", json=scenario_spec(), headers={"Authorization": f"Bearer {submit}"},
            timeout=10,
        )  # fmt: skip
        created.raise_for_status()
        live = Scenario(tmp, api, prometheus, created.json()["id"], cli_env)
        stack.callback(_cancel, live)

        def recovered() -> bool:
            state = live.run()["state"]
            assert state in ("pending", "submitted", "running", "recovering"), (
                f"run went {state}; supervisor log:\n{(tmp / 'supervisor.log').read_text()[-3000:]}"
            )
            return (live.value("sum(nightwatch_supervisor_mttr_seconds_count)") or 0) >= 1

        wait_for(recovered, 420, "the poisoned run to be rolled back and recover")
        yield live


def test_every_panel_and_alert_returns_data_from_the_real_stack(scenario: Scenario) -> None:
    queries = all_queries()
    assert sum(q.kind == "panel" for q in queries) >= 25
    values = {"run_id": scenario.run_id}
    # Just after recovery a few series may still wait for their second scrape (increase()).
    deadline = time.monotonic() + 30
    while bad := failures(run_queries(queries, scenario.prometheus, values)):
        assert time.monotonic() < deadline, "\n".join(bad)
        time.sleep(1)
    assert scenario.run()["state"] == "running"  # the run_* gauges were read while active


def test_report_cli_tells_the_story(scenario: Scenario) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor.cli", "report", scenario.run_id, *args],
            cwd=REPO, env=scenario.cli_env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    png = scenario.tmp / "report.png"
    done = cli("--plot", str(png))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    run = scenario.run()
    (lo, hi), *_ = run["skip_ranges"]
    assert lo <= POISON[0] and hi >= POISON[1]
    for needle in (
        "loss_spike began at step",  # the fault
        "loss_spike detected at step",  # the detection
        f"rollback step={run['resume_step']}",  # the remedy
        f"skip [{lo}, {hi})",  # the skipped window, on the new attempt
        "attempt 2 started",
        "loss_spike recovered (MTTR",
    ):
        assert needle in text, f"{needle!r} missing from the report:\n{text}"

    body = httpx.get(
        f"{scenario.api}/v1/runs/{scenario.run_id}/report", headers=scenario.headers, timeout=30
    ).json()
    windows = {w["kind"]: w for w in body["windows"]}
    assert windows["skipped"]["start_step"] <= POISON[0] // BATCH + 1
    assert "rollback" in windows
    # the curve is Prometheus's (per attempt, every scrape), not only the checkpoints' losses
    scraped = [p for p in body["loss"] if p.get("source") != "checkpoint"]
    assert {p["attempt"] for p in scraped} >= {1, 2}
    assert len(scraped) >= 8  # one per scrape (1 s) that saw a new step

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    px = imread(png)[..., :3]
    reddish = (px[..., 0] > 0.85) & (px[..., 1] < 0.8) & (px[..., 2] < 0.8)
    assert reddish.sum() > 2_000  # the skipped window's hatch
    assert len(np.unique((px.reshape(-1, 3) * 20).round(), axis=0)) > 50


def test_loss_history_joins_real_scrapes(scenario: Scenario) -> None:
    """`supervisor.metrics_in.loss_history`: step and loss pair up by scrape timestamp."""
    points = loss_history(scenario.prometheus, scenario.run_id, since=time.time() - 900)
    by_attempt: dict[int | None, list[int]] = {}
    for p in points:
        by_attempt.setdefault(p.attempt, []).append(p.step)
    assert set(by_attempt) >= {1, 2}
    for steps in by_attempt.values():
        assert steps == sorted(set(steps))  # one point per step seen, in order
    # no placeholder: a process exports loss 0 at its resume step until its first step ends
    assert min(p.loss for p in points) > 1.0
    # attempt 1 was scraped before and inside the poisoned window, attempt 2 after it
    assert min(by_attempt[1]) < POISON[0] // BATCH < max(by_attempt[1])
    assert max(by_attempt[2]) > max(by_attempt[1])
    assert loss_history("http://127.0.0.1:9", scenario.run_id, since=time.time()) == []
