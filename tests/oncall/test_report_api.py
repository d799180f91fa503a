"""`GET /v1/runs/{id}/report` on a real (SQLite) database, and `nightwatch report` over HTTP."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import supervisor.cli.report  # noqa: F401  (registers `nightwatch report`)
from contracts.spec import RunSpec
from supervisor import store
from supervisor.api.app import create_app
from supervisor.api.routes import report as report_route
from supervisor.auth import Scope
from supervisor.cli import app as cli
from supervisor.db import Database
from supervisor.metrics_in import LossPoint
from supervisor.models import AttemptState, IncidentState, RunState
from supervisor.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def _with_report_route(app: FastAPI) -> FastAPI:
    """Register the route unless the app already does (the lead adds it to create_app)."""
    if not any(getattr(r, "path", "") == "/v1/runs/{run_id}/report" for r in app.routes):
        app.include_router(report_route.router)
    return app


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    db = Database(f"sqlite:///{tmp_path / 'nightwatch.db'}")
    db.upgrade()
    yield db
    db.dispose()


@pytest.fixture
def read_token(database: Database) -> str:
    with database.write_session() as session:
        return store.create_token(session, "oncall", [Scope.READ])[1]


@pytest.fixture
def app(database: Database, tmp_path: Path) -> FastAPI:
    settings = Settings(home=tmp_path / "home")
    return _with_report_route(create_app(settings, database=database, registry=CollectorRegistry()))


@pytest.fixture
def run_id(database: Database) -> str:
    """A run that spiked at step 41, was rolled back to 30 skipping samples, and finished."""
    t0 = datetime.now(UTC) - timedelta(minutes=10)
    spec = RunSpec.from_file(REPO / "examples" / "tiny-cpu.yaml")
    with database.write_session() as s:
        run, _ = store.create_run(s, spec)
        rid = run.id
        store.create_attempt(s, rid, executor="local", job_id="101")
        store.update_attempt(
            s, rid, 1, state=AttemptState.CANCELLED, started_at=t0, nodes_json=["n1"],
            ended_at=t0 + timedelta(seconds=95), end_reason="rollback",
        )  # fmt: skip
        incident = store.open_incident(
            s, rid, 1, "loss_spike", evidence={"last_healthy_step": 40, "first_bad_step": 41},
            fault_ts=t0 + timedelta(seconds=80),
        )  # fmt: skip
        store.update_incident(
            s, incident.id, detected_ts=t0 + timedelta(seconds=87), remedy="rollback",
            state=IncidentState.RECOVERED, recovered_ts=t0 + timedelta(seconds=130),
            steps_lost=13,
        )  # fmt: skip
        action = store.begin_action(s, rid, 1, "rollback", "step 30", {"skip": [320, 352]})
        assert action is not None
        store.finish_action(s, action.key, ok=True, result={})
        store.create_attempt(
            s, rid, executor="local", job_id="102", resume_step=30, skip_ranges=[[320, 352]]
        )
        store.update_attempt(
            s, rid, 2, state=AttemptState.COMPLETED, started_at=t0 + timedelta(seconds=115),
            ended_at=t0 + timedelta(seconds=300), nodes_json=["n1"],
        )  # fmt: skip
        for step in (10, 20, 30, 40, 60, 120):
            store.record_checkpoint(
                s, rid, step=step, consumed_samples=8 * step, loss=8.0 / (1 + 0.05 * step),
                path=f"/ckpt/iter_{step:07d}", saved_at=t0 + timedelta(seconds=2 * step),
                complete=True,
            )  # fmt: skip
        store.update_run(
            s, rid, state=RunState.SUCCEEDED, state_reason="reached train_steps", last_step=120,
            skip_ranges_json=[[320, 352]], excluded_nodes_json=[],
        )  # fmt: skip
    return rid


def test_report_route(app: FastAPI, read_token: str, run_id: str) -> None:
    with TestClient(app) as client:
        r = client.get(
            f"/v1/runs/{run_id}/report", headers={"Authorization": f"Bearer {read_token}"}
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["state"] == "succeeded" and body["attempts"] == 2
    assert body["steps_lost"] == 13
    assert body["downtime_s"] == pytest.approx(20, abs=0.01)
    assert body["wall_s"] == pytest.approx(300, abs=0.01)
    assert [i["kind"] for i in body["incidents"]] == ["loss_spike"]
    assert body["incidents"][0]["onset_step"] == 41
    assert [p["step"] for p in body["loss"]] == [10, 20, 30, 40, 60, 120]
    assert {w["kind"] for w in body["windows"]} == {"rollback", "skipped"}
    timeline = " | ".join(e["text"] for e in body["timeline"])
    assert "loss_spike detected at step 41" in timeline
    assert "rollback step 30 [done]" in timeline


def test_report_route_uses_the_loss_history_when_configured(
    app: FastAPI, read_token: str, run_id: str
) -> None:
    asked: list[str] = []

    def history(rid: str) -> list[LossPoint]:
        asked.append(rid)
        return [LossPoint(s, 9.0 - 0.01 * s, 2, 1_800_000_000.0 + s) for s in range(31, 40)]

    app.state.loss_history = history
    with TestClient(app) as client:
        body = client.get(
            f"/v1/runs/{run_id}/report", headers={"Authorization": f"Bearer {read_token}"}
        ).json()
    assert asked == [run_id]
    assert sum(p["source"] == "metrics" for p in body["loss"]) == 9
    assert body["mean_step_s"] == pytest.approx(1.0)


def test_without_prometheus_the_curve_and_ettr_come_from_the_trainers_step_lines(
    app: FastAPI, read_token: str, run_id: str, tmp_path: Path
) -> None:
    """The embedded default has no Prometheus server: the report reads the `step` lines rank 0
    logged on each attempt's first node (a torn line and a NaN step are left out)."""
    t0 = 1_800_000_000.0
    for attempt, job, steps in ((1, "101", range(1, 42)), (2, "102", range(31, 121))):
        log = tmp_path / "home" / "runs" / run_id / "logs" / f"a{attempt}" / job
        log.mkdir(parents=True)
        lines = [
            json.dumps(
                {
                    "ts": t0 + 2 * s + 100 * (attempt - 1),
                    "event": "step",
                    "step": s,
                    "loss": "NaN" if s == 41 else 9.0 - 0.01 * s,
                }
            )
            for s in steps
        ]
        (log / f"{job}_0_log.out").write_text("\n".join([*lines, '{"ts": 1, "event": "st']))
    with TestClient(app) as client:
        body = client.get(
            f"/v1/runs/{run_id}/report", headers={"Authorization": f"Bearer {read_token}"}
        ).json()
    logged = [p for p in body["loss"] if p["source"] == "log"]
    assert len(logged) == 40 + 89 and {p["attempt"] for p in logged} == {1, 2}
    assert body["mean_step_s"] == pytest.approx(2.0)
    assert body["ettr"] is not None


def test_report_route_needs_a_token_and_a_run(app: FastAPI, read_token: str) -> None:
    with TestClient(app) as client:
        assert client.get("/v1/runs/r-000000000000/report").status_code == 401
        missing = client.get(
            "/v1/runs/r-000000000000/report", headers={"Authorization": f"Bearer {read_token}"}
        )
    assert missing.status_code == 404


@pytest.fixture
def live_url(app: FastAPI) -> Iterator[str]:
    """uvicorn on 127.0.0.1 (the CLI speaks real HTTP)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/healthz", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_cli_report_text_json_and_plot(
    live_url: str, read_token: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NIGHTWATCH_URL", live_url)
    monkeypatch.setenv("NIGHTWATCH_TOKEN", read_token)
    runner = CliRunner()
    text = runner.invoke(cli, ["report", run_id])
    assert text.exit_code == 0, text.output
    assert f"Run {run_id} (tiny-cpu): SUCCEEDED" in text.output
    assert "loss_spike detected at step 41" in text.output
    plot = tmp_path / "out.png"
    js = runner.invoke(cli, ["report", run_id, "--format", "json", "--plot", str(plot)])
    assert js.exit_code == 0, js.output
    assert '"steps_lost": 13' in js.output
    assert plot.read_bytes()[:4] == b"\x89PNG" and plot.stat().st_size > 10_000
    missing = runner.invoke(cli, ["report", "r-000000000000"])
    assert missing.exit_code == 1
    assert "HTTP 404" in missing.output
