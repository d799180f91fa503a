"""A real Prometheus server on loopback scraping a prometheus_client exporter the test drives.

Ports are picked by binding to port 0; everything lives in a pytest tmp dir and the server is
stopped (SIGTERM, then SIGKILL) when the fixture ends, so nothing outlives the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from worker.local_launch import free_port

PROMETHEUS = "/usr/bin/prometheus"
LABELS = ("run_id", "attempt", "node")


@dataclass
class Exporter:
    """One worker node's endpoint with the contract's metric names."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    port: int = 0
    gauges: dict[str, Gauge] = field(default_factory=dict)
    counters: dict[str, Counter] = field(default_factory=dict)
    _server: object | None = None
    _frozen: socket.socket | None = None

    def start(self) -> Exporter:
        server, _thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self._server = server
        self.port = int(server.server_address[1])
        return self

    def stop(self) -> None:
        """Gone, as when the node's processes exited: a scrape is refused at once."""
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
            self._server = None
        if self._frozen is not None:
            self._frozen.close()
            self._frozen = None

    def freeze(self) -> None:
        """Silent, as a frozen host: the port stays open and the kernel takes connections,
        but no answer ever comes, so a scrape fails only at its timeout."""
        self.stop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(128)
        self._frozen = sock

    def set(self, name: str, labels: tuple[str, str, str], value: float) -> None:
        if name not in self.gauges:
            self.gauges[name] = Gauge(name, name, LABELS, registry=self.registry)
        self.gauges[name].labels(*labels).set(value)

    def inc(self, name: str, labels: tuple[str, str, str], value: float = 1.0) -> None:
        base = name.removesuffix("_total")
        if base not in self.counters:
            self.counters[base] = Counter(base, base, LABELS, registry=self.registry)
        self.counters[base].labels(*labels).inc(value)


class PrometheusServer:
    """`/usr/bin/prometheus` on 127.0.0.1 with a 1 s scrape of the given loopback ports."""

    def __init__(
        self,
        workdir: Path,
        targets: list[int],
        interval: str = "1s",
        labels: list[dict[str, str]] | None = None,
    ) -> None:
        """`labels`, one per target, are target labels (as the supervisor's service discovery
        gives each endpoint its run, attempt and node), so `up` carries them too."""
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        groups = [
            {"targets": [f"127.0.0.1:{p}"], "labels": label}
            for p, label in zip(targets, labels or [{} for _ in targets], strict=True)
        ]
        config = workdir / "prometheus.yml"
        config.write_text(  # JSON is valid YAML
            json.dumps(
                {
                    "global": {"scrape_interval": interval, "scrape_timeout": interval},
                    "scrape_configs": [
                        {
                            "job_name": "nightwatch-train",
                            "honor_labels": True,
                            "static_configs": groups or [{"targets": []}],
                        }
                    ],
                }
            )
        )
        self.config = config

    def start(self, timeout_s: float = 30.0) -> None:
        log = (self.workdir / "prometheus.log").open("ab")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()}"
                )
            time.sleep(0.2)
        raise TimeoutError("prometheus did not become ready")

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def wait_for_series(self, query: str, count: int = 1, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{self.url}/api/v1/query", params={"query": query}, timeout=2)
                if len(r.json()["data"]["result"]) >= count:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"no series for {query}")


@contextlib.contextmanager
def running_prometheus(workdir: Path, targets: list[int]) -> Iterator[PrometheusServer]:
    server = PrometheusServer(workdir, targets)
    server.start()
    try:
        yield server
    finally:
        server.stop()
