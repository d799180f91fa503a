"""`nightwatch serve --workers N`: N API processes, one reconciler, one /metrics.

One process tops out near 450 requests/s here (the GIL; ≈ 2-2.5 ms of CPU a request), so for
more the API runs as N uvicorn worker processes, while the reconciler stays a single thread in
the parent (its lease would make more of them safe, but one is all it needs). /metrics, served
by whichever worker the scrape reaches, must still show one supervisor:

* the workers' request metrics are prometheus_client multiprocess metrics: each process writes
  its values to a file in `NIGHTWATCH_METRICS_DIR`, and /metrics sums them (counters,
  histograms) or takes the newest (the run-count gauge, set from the database per scrape);
* the reconciler's metrics stay ordinary ones in the parent (per-run gauges must be removable
  when a run ends, which multiprocess mode cannot do); the parent writes their exposition to
  `reconciler.prom` in that directory after every tick, and /metrics appends the file — the
  textfile pattern of node_exporter.

The multiprocess directory is given to the workers only (prometheus_client reads
PROMETHEUS_MULTIPROC_DIR once, at import): the parent's own metrics and the training jobs it
launches, which inherit its environment, keep ordinary in-process metrics.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry

METRICS_DIR_ENV = "NIGHTWATCH_METRICS_DIR"
RECONCILER_METRICS = "reconciler.prom"


def fresh_metrics_dir(home: Path, port: int) -> Path:
    """An empty directory for this server's metric files (old files would add stale counts)."""
    path = home / "metrics" / str(port)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def create_worker_app() -> FastAPI:
    """uvicorn's app factory in each worker process (`--factory`)."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before multiprocess mode was set")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.environ[METRICS_DIR_ENV]

    from supervisor.api.app import create_app
    from supervisor.logs import configure_logging
    from supervisor.settings import Settings

    configure_logging()
    return create_app(Settings.from_env(), metrics_dir=Path(os.environ[METRICS_DIR_ENV]))


def exposition(metrics_dir: Path) -> bytes:
    """/metrics of a worker: every worker's metrics merged, then the reconciler's."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    try:
        reconciler = (metrics_dir / RECONCILER_METRICS).read_bytes()
    except FileNotFoundError:
        reconciler = b""
    return generate_latest(registry) + reconciler


class MetricsFileWriter:
    """Writes a registry's exposition to `reconciler.prom` every `interval_s` (atomically)."""

    def __init__(self, registry: CollectorRegistry, metrics_dir: Path, interval_s: float) -> None:
        self.registry = registry
        self.path = metrics_dir / RECONCILER_METRICS
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-file", daemon=True)

    def write(self) -> None:
        from prometheus_client import generate_latest

        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(generate_latest(self.registry))
        tmp.replace(self.path)

    def start(self) -> None:
        self.write()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()
