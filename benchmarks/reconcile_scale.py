"""Benchmark: one reconcile tick over N active runs (default 1,000).

Real parts: a real Prometheus server (`/usr/bin/prometheus` on 127.0.0.1, 1 s scrape) loaded
with synthetic series of every run (a prometheus_client exporter with the contract's metric
names, two nodes per run, values moving every second), the PrometheusSource, the SQLite
store, detectors, policy and reconciler. Fake: SLURM (one batched poll answering RUNNING for
every job), as the real one cannot hold 1,000 jobs on one machine.

    .venv/bin/python benchmarks/reconcile_scale.py [--runs 1000] [--ticks 8]

Prints the cold tick (first: whole trailing window fetched) and the steady ticks (only what
arrived since the previous tick), and exits 1 when the steady median exceeds --target (1 s).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Gauge, start_http_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contracts.spec import RunSpec
from supervisor import store
from supervisor.db import Database
from supervisor.metrics_in import PrometheusSource
from supervisor.models import RunState
from supervisor.slurm import JobRequest, JobState, JobStatus, LiveJob, NodeInfo, Submission
from supervisor.watchdog.reconciler import Reconciler, WatchdogConfig
from worker.local_launch import free_port

SPEC = {
    "name": "bench",
    "model": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
        "vocab_size": 256,
    },
    "resources": {"device": "cpu", "nodes": 2, "gpus_per_node": 1},
    "parallelism": {"data": 2},
    "training": {"train_steps": 1_000_000, "global_batch_size": 8},
}
LABELS = ("run_id", "attempt", "node")
GAUGES = (
    "step",
    "last_step_timestamp_seconds",
    "target_steps",
    "loss",
    "loss_window_max",
    "loss_window_min",
    "grad_norm",
    "grad_norm_window_max",
    "nonfinite_steps_total",
    "tokens_per_second",
    "samples_consumed",
    "checkpoint_step",
    "checkpoint_last_timestamp_seconds",
    "checkpoint_failures_total",
    "replica_mismatches_total",
    "up",
    "step_time_window_avg_seconds",
)
NODE_LEVEL = {"step", "last_step_timestamp_seconds", "up", "step_time_window_avg_seconds"}


class BatchCluster:
    """SLURM stand-in: one batched poll, every job RUNNING on two nodes."""

    kind = "slurm"

    def __init__(self) -> None:
        self.polls = 0

    def poll(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        self.polls += 1
        return {j: JobStatus(j, JobState.RUNNING, ("n1", "n2")) for j in job_ids}

    def submit(self, request: JobRequest, fn: Callable[[], object]) -> Submission:
        raise AssertionError("the benchmark's runs are all running")

    def find_jobs(self, job_name: str) -> list[str]:
        return []

    def live_jobs(self, prefix: str) -> dict[str, LiveJob]:
        return {}

    def finish_submission(self, job_id: str, log_dir: Path) -> bool:
        return False

    def cancel(self, job_id: str) -> None:
        raise AssertionError("a healthy fleet needs no remedy")

    def requeue(self, job_id: str) -> None: ...
    def signal(self, job_id: str, sig: str = "USR2") -> None: ...
    def drain(self, node: str, reason: str) -> None: ...
    def resume_node(self, node: str) -> None: ...

    def nodes(self) -> dict[str, NodeInfo]:
        return {}

    def log_files(self, job_id: str, log_dir: Path | None = None) -> list[Path]:
        return []


class FleetExporter:
    """All runs' series on one endpoint; advances every run one step per second.

    Runs in its own process (as workers do), so its Python work does not compete with the
    reconciler for the GIL and distort the measurement.
    """

    def __init__(self, run_ids: list[str]) -> None:
        parent, child = multiprocessing.Pipe()
        self.proc = multiprocessing.Process(target=_serve_fleet, args=(run_ids, child), daemon=True)
        self.proc.start()
        self.port = int(parent.recv())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.join(10)


def _serve_fleet(run_ids: list[str], conn: Connection) -> None:
    registry = CollectorRegistry()
    # Counters are exposed as gauges here: only the sample names matter to PromQL.
    g = {n: Gauge(f"nightwatch_train_{n}", n, LABELS, registry=registry) for n in GAUGES}
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    tick = 0
    while True:
        tick += 1
        now = time.time()
        for i, run_id in enumerate(run_ids):
            step = tick + i % 7
            loss = 2.5 + 6 * math.exp(-step / 300) + 0.02 * math.sin(step * 1.3 + i)
            for node in ("n1", "n2"):
                lab = (run_id, "1", node)
                g["step"].labels(*lab).set(step)
                g["last_step_timestamp_seconds"].labels(*lab).set(now)
                g["up"].labels(*lab).set(1)
                g["step_time_window_avg_seconds"].labels(*lab).set(1.0)
            lab = (run_id, "1", "n1")
            for name, value in (
                ("target_steps", 1_000_000),
                ("loss", loss),
                ("loss_window_max", loss + 0.02),
                ("loss_window_min", loss - 0.02),
                ("grad_norm", 1.0),
                ("grad_norm_window_max", 1.2),
                ("nonfinite_steps_total", 0),
                ("tokens_per_second", 2048.0),
                ("samples_consumed", step * 8),
                ("checkpoint_step", step - step % 100),
                ("checkpoint_last_timestamp_seconds", now),
                ("checkpoint_failures_total", 0),
                ("replica_mismatches_total", 0),
            ):
                g[name].labels(*lab).set(value)
        if tick == 1:
            conn.send(server.server_address[1])
        time.sleep(max(0.0, 1.0 - (time.time() - now)))


@contextlib.contextmanager
def prometheus(workdir: Path, target_ports: Sequence[int]):  # type: ignore[no-untyped-def]
    port = free_port()
    config = workdir / "prometheus.yml"
    targets = ", ".join(f"'127.0.0.1:{p}'" for p in target_ports)
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
        f"  - job_name: fleet\n    static_configs:\n      - targets: [{targets}]\n"
    )
    proc = subprocess.Popen(
        [
            "/usr/bin/prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


def wait_for_fleet(url: str, runs: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError):
            r = httpx.get(f"{url}/api/v1/query", params={"query": "count(nightwatch_train_loss)"})
            result = r.json()["data"]["result"]
            if result and int(float(result[0]["value"][1])) >= runs:
                return
        time.sleep(0.5)
    raise TimeoutError("Prometheus never saw the whole fleet")


def _scrape_seconds(url: str) -> str:
    r = httpx.get(
        f"{url}/api/v1/query", params={"query": "max(max_over_time(scrape_duration_seconds[1m]))"}
    )
    result = r.json()["data"]["result"]
    return f"≤ {float(result[0]['value'][1]):.2f} s" if result else "unknown"


def seed_runs(db: Database, n: int) -> list[str]:
    spec = RunSpec.model_validate(SPEC)
    ids = []
    for i in range(n):
        with db.write_session() as s:
            run, _ = store.create_run(s, spec)
            store.create_attempt(s, run.id, executor="slurm", job_id=str(10_000 + i))
            store.transition_run(s, run.id, RunState.SUBMITTED)
            store.transition_run(s, run.id, RunState.RUNNING)
            ids.append(run.id)
    return ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--ticks", type=int, default=8)
    parser.add_argument("--target", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nw-bench-") as tmp:
        work = Path(tmp)
        db = Database(f"sqlite:///{work / 'nw.db'}")
        db.upgrade()
        t0 = time.perf_counter()
        run_ids = seed_runs(db, args.runs)
        print(f"seeded {len(run_ids)} running runs in {time.perf_counter() - t0:.1f} s")
        # Several endpoints, as a fleet's workers would have: one per 250 runs.
        exporters = [FleetExporter(run_ids[i : i + 250]) for i in range(0, len(run_ids), 250)]
        try:
            with prometheus(work, [e.port for e in exporters]) as url:
                wait_for_fleet(url, args.runs)
                time.sleep(5)  # a few scrapes of history for the trailing window
                cluster = BatchCluster()
                source = PrometheusSource(url, window_s=300, stale_after_s=15)
                rec = Reconciler(db, cluster, source, WatchdogConfig(home=work / "home"))
                cold = rec.tick()
                assert cold.runs == args.runs and not cold.errors, cold.errors
                steady = []
                results = []
                for _ in range(args.ticks):
                    time.sleep(1.0)
                    result = rec.tick()
                    assert result.slurm_up and result.metrics_up and not result.errors
                    assert not result.remedies, result.remedies
                    steady.append(result.duration_s)
                    results.append(result)
                samples = source.history.view((run_ids[0], 1), time.time()).samples
                scrape = _scrape_seconds(url)
        finally:
            for e in exporters:
                e.close()
        db.dispose()
    med = statistics.median(steady)
    phases = {
        k: statistics.median(r.phases.get(k, 0.0) for r in results)
        for k in ("slurm", "metrics", "runs")
    }
    cpu = statistics.median(r.cpu_s for r in results)
    load = os.getloadavg()[0]
    print(
        f"reconcile tick over {args.runs} active runs: cold {cold.duration_s:.3f} s, "
        f"steady median {med:.3f} s (min {min(steady):.3f}, max {max(steady):.3f}, "
        f"{len(steady)} ticks); {source.queries / (len(steady) + 1):.0f} PromQL queries per tick, "
        f"{cluster.polls} SLURM polls in {len(steady) + 1} ticks; "
        f"window {len(samples)} samples/run; Prometheus scrape of the fleet {scrape}"
    )
    print(
        "  steady phases (median s): "
        + ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
        + f"; CPU {cpu:.3f} s per tick; machine load average {load:.1f} on {os.cpu_count()} CPUs"
    )
    return 0 if med <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
