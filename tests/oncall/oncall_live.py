"""A live monitoring stack for the on-call tests: a real Prometheus, run from the repository's own
prometheus.yml and alerts.yml, scraping the training program's real metrics code
(`megatron_runs.metrics.TrainMetrics`, driven with synthetic steps) and a supervisor exporter
built from the contract's `nightwatch_supervisor_*` names.

The worker endpoints are discovered through an HTTP-SD server that demands the bearer token
from the credentials file, exactly as the supervisor's `/v1/prometheus/targets` does, so the
config's discovery and auth wiring is exercised too. Everything listens on 127.0.0.1 on ports
the kernel picks.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from megatron_runs.metrics import StepReport, TrainMetrics
from worker.local_launch import free_port

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "dashboards" / "prometheus"
RUN_ID = "r-0ca11ed0beef"
TICK_SECONDS = 0.25


class WorkerNode:
    """One node's /metrics, served by the training program's own `TrainMetrics`."""

    def __init__(self, node: str, *, rank0: bool, step_time: float) -> None:
        self.metrics = TrainMetrics(RUN_ID, 1, node, run_level=rank0)
        self.node, self.step_time = node, step_time
        self.labels = {"run_id": RUN_ID, "attempt": "1", "node": node}
        self.server, _ = start_http_server(0, addr="127.0.0.1", registry=self.metrics.registry)
        self.metrics.start(target_steps=10_000, step=0, samples_consumed=0)
        self.metrics.set_up(True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_port}"

    def step(self, step: int, now: float) -> None:
        """One healthy training step, with a checkpoint and a replica check now and then."""
        loss = 8.0 / (1 + 0.05 * step)
        report = StepReport(
            step=step, loss=loss, grad_norm=1.2, lr=3e-4, tokens=8 * 128,
            samples_consumed=step * 8, skipped=0, step_time=self.step_time,
            node_step_time=self.step_time, mfu=0.41,
        )  # fmt: skip
        self.metrics.on_step(report)
        if step % 5 == 0:
            self.metrics.on_replica_check(mismatch=False)
        if step % 10 == 0:
            self.metrics.on_checkpoint(step, duration=0.4, ok=True)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Supervisor:
    """The supervisor's `nightwatch_supervisor_*` metrics as docs/contracts.md names them."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "nightwatch_supervisor"
        self.runs = Gauge(f"{p}_runs", "runs", ["state"], registry=r)
        self.incidents = Counter(f"{p}_incidents_total", "incidents", ["kind"], registry=r)
        self.remedies = Counter(f"{p}_remedies_total", "remedies", ["kind"], registry=r)
        self.detection = Histogram(f"{p}_detection_latency_seconds", "detect", registry=r)
        self.mttr = Histogram(f"{p}_mttr_seconds", "mttr", registry=r)
        self.tick = Histogram(f"{p}_tick_duration_seconds", "tick", registry=r)
        self.last_tick = Gauge(f"{p}_last_tick_timestamp_seconds", "last tick", registry=r)
        self.source_up = Gauge(f"{p}_source_up", "source up", ["source"], registry=r)
        self.excluded = Gauge(f"{p}_excluded_nodes", "excluded", registry=r)
        self.ettr = Gauge(f"{p}_run_ettr_ratio", "ettr", ["run_id"], registry=r)
        self.budget = Gauge(f"{p}_run_recovery_budget_left", "budget", ["run_id"], registry=r)
        self.ckpt_age = Gauge(f"{p}_run_checkpoint_age_seconds", "age", ["run_id"], registry=r)
        self.attention = Gauge(f"{p}_run_needs_attention", "escalated", ["run_id"], registry=r)
        self.run_incidents = Gauge(
            f"{p}_run_incidents", "the run's incidents", ["run_id", "kind"], registry=r
        )
        self.server, _ = start_http_server(0, addr="127.0.0.1", registry=r)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_port}"

    def tick_once(self, step: int, now: float) -> None:
        for state in ("pending", "running", "recovering", "needs_attention", "succeeded"):
            self.runs.labels(state=state).set(1 if state == "running" else 0)
        for source in ("prometheus", "scrape", "slurm"):
            self.source_up.labels(source=source).set(1)
        self.tick.observe(0.02 + 0.001 * (step % 7))
        self.last_tick.set(now)
        self.excluded.set(1)
        self.ettr.labels(run_id=RUN_ID).set(0.93)
        self.budget.labels(run_id=RUN_ID).set(4 if step < 20 else 3)
        self.ckpt_age.labels(run_id=RUN_ID).set(5.0 + step % 10)
        self.attention.labels(run_id=RUN_ID).set(0)
        if step % 6 == 0:  # a fault every few steps: detected, remedied, recovered
            self.incidents.labels(kind="loss_spike").inc()
            self.run_incidents.labels(run_id=RUN_ID, kind="loss_spike").inc()
            self.remedies.labels(kind="rollback").inc()
            self.detection.observe(4.0 + step % 3)
            self.mttr.observe(60.0 + step)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class HttpSd:
    """`GET /v1/prometheus/targets` with bearer auth, as the supervisor serves it."""

    token: str
    groups: list[dict[str, Any]]
    unauthorized: int = 0
    served: int = 0
    server: ThreadingHTTPServer = field(init=False)

    def __post_init__(self) -> None:
        sd = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.headers.get("Authorization") != f"Bearer {sd.token}":
                    sd.unauthorized += 1
                    self.send_response(401)
                    self.end_headers()
                    return
                sd.served += 1
                body = json.dumps(sd.groups).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/v1/prometheus/targets"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class LivePrometheus:
    url: str
    sd: HttpSd
    nodes: list[WorkerNode]
    supervisor: Supervisor

    def query(self, expr: str) -> list[Any]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]


def prometheus_config(sd_url: str, supervisor: str, token_file: Path) -> dict[str, Any]:
    """The repository's prometheus.yml with only addresses, paths and intervals swapped."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / "alerts.yml")]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["nightwatch-supervisor"]["static_configs"] = [{"targets": [supervisor]}]
    workers = jobs["nightwatch-workers"]
    workers.update(scrape_interval="1s", scrape_timeout="1s")
    (sd,) = workers["http_sd_configs"]
    sd.update(url=sd_url, refresh_interval="1s")
    sd["authorization"]["credentials_file"] = str(token_file)
    return config


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _driven(nodes: list[WorkerNode], supervisor: Supervisor, stop: threading.Event) -> None:
    """Steps every TICK_SECONDS until stopped: the run trains, the supervisor ticks."""
    step = 0
    while not stop.is_set():
        step += 1
        now = time.time()
        for node in nodes:
            node.step(step, now)
        supervisor.tick_once(step, now)
        stop.wait(TICK_SECONDS)


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_prometheus(stack: ExitStack, tmp: Path, config: dict[str, Any]) -> str:
    """Start Prometheus on a free loopback port with `config`; stopped when `stack` closes."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("the `prometheus` binary is required (Debian package prometheus)")
    config_file = tmp / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = stack.enter_context((tmp / "prometheus.log").open("w"))
    proc = subprocess.Popen(
        [binary, f"--config.file={config_file}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    stack.callback(_stop_process, proc)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, 30, "ready")
    return url


@contextmanager
def running_stack(tmp: Path) -> Iterator[LivePrometheus]:
    """Prometheus scraping a simulated two-node run and the supervisor, with data flowing.

    Yields once every target has been scraped a few times (enough for rate() / increase());
    everything it started is stopped on exit.
    """
    with ExitStack() as stack:
        nodes = [
            WorkerNode("n1", rank0=True, step_time=0.5),
            WorkerNode("n2", rank0=False, step_time=0.9),
        ]
        for node in nodes:
            stack.callback(node.close)
        supervisor = Supervisor()
        stack.callback(supervisor.close)
        sd = HttpSd(
            secrets.token_urlsafe(16),
            [{"targets": [n.address], "labels": dict(n.labels)} for n in nodes],
        )
        stack.callback(sd.close)
        token_file = tmp / "nightwatch_token"
        token_file.write_text(sd.token + "\n")
        url = start_prometheus(
            stack, tmp, prometheus_config(sd.url, supervisor.address, token_file)
        )
        stop = threading.Event()
        driver = threading.Thread(target=_driven, args=(nodes, supervisor, stop), daemon=True)
        driver.start()
        stack.callback(driver.join, 5)
        stack.callback(stop.set)
        live = LivePrometheus(url, sd, nodes, supervisor)
        wait_for(
            lambda: len(live.query("count_over_time(up[1m]) >= 5 and up == 1")) == 3,
            45,
            "three targets scraped five times",
        )
        yield live
