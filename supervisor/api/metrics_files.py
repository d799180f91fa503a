"""The merged /metrics of `serve --workers N` (see `supervisor.api.workers_mode`).

The workers' request metrics are prometheus_client multiprocess files in the metrics
directory; the reconciler, in the parent, writes its own exposition to `reconciler.prom` there
after every tick and each worker appends it (node_exporter's textfile pattern).
"""

from __future__ import annotations

import threading
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest, multiprocess

RECONCILER_METRICS = "reconciler.prom"


def exposition(metrics_dir: Path) -> bytes:
    """/metrics of a worker: every worker's metrics merged, then the reconciler's."""
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
