"""Alerts that reach someone: the rendered Alertmanager file checked and routed by the real
`amtool`, every alert rule pointing at a runbook and a dashboard, and a fired alert delivered
end to end — real Prometheus evaluating the repository's alerts.yml, real Alertmanager (Debian's
prometheus-alertmanager) routing it, a webhook receiver on loopback taking it."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from oncall_live import free_port
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from typer.testing import CliRunner

from supervisor.alert_routing import AlertRouting, render_yaml
from supervisor.cli import app

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "dashboards" / "prometheus" / "alerts.yml"
WEBHOOK = "http://127.0.0.1:9/hook"
SLACK = "https://hooks.slack.invalid/services/T0/B0/x"


def _binary(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is required (Debian package {package})")
    return found


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_binary("amtool", "prometheus-alertmanager"), *args],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def _write(tmp_path: Path, routing: AlertRouting) -> Path:
    path = tmp_path / "alertmanager.yml"
    path.write_text(render_yaml(routing))
    return path


@pytest.mark.parametrize(
    "routing",
    [AlertRouting(), AlertRouting(webhook_url=WEBHOOK), AlertRouting(slack_url=SLACK),
     AlertRouting(webhook_url=WEBHOOK, slack_url=SLACK, runbook_base_url="https://x/blob/main")],
    ids=["none", "webhook", "slack", "both"],
)  # fmt: skip
def test_rendered_config_passes_amtool(tmp_path: Path, routing: AlertRouting) -> None:
    result = amtool("check-config", str(_write(tmp_path, routing)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(routing.receivers) + 1} receivers" in result.stdout


@pytest.mark.parametrize(
    ("routing", "severity", "receivers"),
    [(AlertRouting(webhook_url=WEBHOOK, slack_url=SLACK), "page", "webhook,slack"),
     (AlertRouting(webhook_url=WEBHOOK, slack_url=SLACK), "ticket", "webhook"),
     (AlertRouting(slack_url=SLACK), "ticket", "discard"),
     (AlertRouting(), "page", "discard")],
)  # fmt: skip
def test_routes(tmp_path: Path, routing: AlertRouting, severity: str, receivers: str) -> None:
    config = _write(tmp_path, routing)
    labels = ["alertname=NightwatchRunNeedsAttention", f"severity={severity}", "run_id=r1"]
    result = amtool("config", "routes", "test", f"--config.file={config}", *labels)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == receivers


def test_routing_from_the_environment() -> None:
    routing = AlertRouting.from_env({"NIGHTWATCH_ALERT_WEBHOOK_URL": WEBHOOK,
                                     "NIGHTWATCH_ALERT_SLACK_CHANNEL": "#oncall"})  # fmt: skip
    assert routing.receivers == ("webhook",) and routing.slack_channel == "#oncall"


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_alert_has_a_runbook_and_a_dashboard() -> None:
    rules = _rules()
    assert len(rules) >= 10
    for rule in rules:
        name, notes = rule["alert"], rule["annotations"]
        assert notes["runbook"] == f"docs/runbooks/{name}.md"
        text = (REPO / notes["runbook"]).read_text()
        for heading in ("What it means.", "What Nightwatch already did.", "What to do."):
            assert f"**{heading}**" in text, f"{name}: runbook lacks {heading}"
        per_run = "run_id" in rule["expr"] or "run_id" in notes["summary"]
        expected = ("/d/nightwatch-run/nightwatch-run?var-run_id={{ $labels.run_id }}" if per_run
                    else "/d/nightwatch-fleet/nightwatch-fleet")  # fmt: skip
        assert notes["dashboard"] == expected, name
    runbooks = {p.stem for p in (REPO / "docs" / "runbooks").glob("*.md")}
    assert runbooks == {r["alert"] for r in rules}


def test_cli_writes_a_private_file_and_warns_without_receivers(tmp_path: Path) -> None:
    out = tmp_path / "am.yml"
    env = {"NIGHTWATCH_ALERT_WEBHOOK_URL": WEBHOOK}
    result = CliRunner().invoke(app, ["alertmanager-config", "--out", str(out)], env=env)
    assert result.exit_code == 0, result.output
    assert out.stat().st_mode & 0o777 == 0o600
    assert yaml.safe_load(out.read_text())["receivers"][1]["webhook_configs"][0]["url"] == WEBHOOK
    bare = CliRunner().invoke(app, ["alertmanager-config"], env={})
    assert bare.exit_code == 0 and "every alert is discarded" in bare.output


class _Receiver:
    """A webhook receiver on loopback that keeps every notification it is sent."""

    def __init__(self) -> None:
        self.notifications: list[dict[str, Any]] = []
        self.arrived = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.notifications.append(json.loads(body))
                receiver.arrived.set()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"


@contextmanager
def _process(args: list[str], log: Path, ready_url: str) -> Iterator[None]:
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(ready_url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{args[0]} not ready: {log.read_text()}"
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_fired_alert_reaches_the_webhook(tmp_path: Path) -> None:
    receiver = _Receiver()
    registry = CollectorRegistry()
    gauge = Gauge("nightwatch_supervisor_run_needs_attention", "runs escalated", ["run_id"],
                  registry=registry)  # fmt: skip
    gauge.labels(run_id="r-escalated").set(1)
    gauge.labels(run_id="r-fine").set(0)
    exporter, _ = start_http_server(0, addr="127.0.0.1", registry=registry)

    am_port, prom_port = free_port(), free_port()
    am_config = _write(tmp_path, AlertRouting(webhook_url=receiver.url, group_wait_s=0))
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "alerting": {"alertmanagers": [{"static_configs": [
            {"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [{"job_name": "nightwatch-supervisor", "static_configs": [
            {"targets": [f"127.0.0.1:{exporter.server_port}"]}]}],
    }))  # fmt: skip
    alertmanager = [
        _binary("prometheus-alertmanager", "prometheus-alertmanager"),
        f"--config.file={am_config}", f"--storage.path={tmp_path / 'am'}",
        f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address=",
    ]  # fmt: skip
    prometheus = [
        _binary("prometheus", "prometheus"), f"--config.file={prom_config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
    ]  # fmt: skip
    try:
        with (
            _process(alertmanager, tmp_path / "am.log", f"http://127.0.0.1:{am_port}/-/ready"),
            _process(prometheus, tmp_path / "prom.log", f"http://127.0.0.1:{prom_port}/-/ready"),
        ):
            deadline = time.monotonic() + 90
            while not any(_escalations(n) for n in receiver.notifications):
                assert time.monotonic() < deadline, f"none arrived: {receiver.notifications}"
                receiver.arrived.wait(1)
    finally:
        exporter.shutdown()
        receiver.server.shutdown()
    (notification,) = [n for n in receiver.notifications if _escalations(n)]
    assert notification["receiver"] == "webhook"
    assert notification["groupLabels"] == {"alertname": "NightwatchRunNeedsAttention",
                                           "run_id": "r-escalated"}  # fmt: skip
    (alert,) = _escalations(notification)
    assert alert["status"] == "firing" and alert["labels"]["severity"] == "page"
    assert alert["annotations"]["runbook"] == "docs/runbooks/NightwatchRunNeedsAttention.md"
    assert alert["annotations"]["dashboard"] == (
        "/d/nightwatch-run/nightwatch-run?var-run_id=r-escalated"
    )


def _escalations(notification: dict[str, Any]) -> list[dict[str, Any]]:
    return [a for a in notification["alerts"]
            if a["labels"]["alertname"] == "NightwatchRunNeedsAttention"]  # fmt: skip
