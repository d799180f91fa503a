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

Each worker listens on its own SO_REUSEPORT socket, so the kernel deals new connections out
among them. uvicorn's `--workers` shares one socket instead, and the first worker to wake
accepts every connection waiting: 32 keep-alive clients connecting at once all landed on one
worker in two tries of five, which then ran at 90 % of its core (and the p99 at 150-300 ms)
while the other idled.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from contracts.logs import UVICORN_LOG_CONFIG

if TYPE_CHECKING:
    from fastapi import FastAPI

METRICS_DIR_ENV = "NIGHTWATCH_METRICS_DIR"
#: uvicorn's exit status for a worker that failed before serving (bad app, port taken):
#: restarting it would fail the same way.
STARTUP_FAILURE = 3
WATCH_INTERVAL_S = 0.5
STOP_TIMEOUT_S = 15.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
WORKER_APP = "supervisor.api.workers_mode:create_worker_app"
#: linux/prctl.h: the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1

log = logging.getLogger("nightwatch.api")


class WorkerStartupFailed(RuntimeError):
    """An API worker exited before it served (the app, its settings or its socket is broken):
    every replacement would fail the same way."""


def serve(host: str, port: int, workers: int, app: str = WORKER_APP) -> None:
    """Run `workers` API processes of the app factory `app` on host:port until SIGTERM or
    SIGINT; replace any that dies after it started serving. Raises OSError if the port is
    taken, WorkerStartupFailed if a worker could not start."""
    _check_free(host, port)
    context = multiprocessing.get_context("spawn")
    # A flag, not an Event: Event.set from a signal handler can deadlock on the lock that the
    # interrupted Event.wait holds.
    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda n, _: signals.append(n)) for sig in STOP_SIGNALS}

    def start() -> multiprocessing.process.BaseProcess:
        process = context.Process(
            target=_serve_worker, args=(host, port, app, os.getpid()), daemon=False
        )
        process.start()
        return process

    processes: list[multiprocessing.process.BaseProcess] = []
    try:
        processes += [start() for _ in range(workers)]
        while not signals:
            time.sleep(WATCH_INTERVAL_S)
            for i, process in enumerate(processes):
                if process.is_alive():
                    continue
                if process.exitcode == STARTUP_FAILURE:
                    raise WorkerStartupFailed(f"API worker {process.pid} failed to start")
                log.warning(f"API worker {process.pid} died (exit {process.exitcode}); replaced")
                processes[i] = start()
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_free(host: str, port: int) -> None:
    """Fail now if anything holds the port: SO_REUSEPORT would let a second server that uses
    it too share the port silently, splitting the traffic between the two."""
    with socket.socket(_family(host)) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _serve_worker(host: str, port: int, app: str, parent: int) -> None:
    """One worker process: its own listening socket in the port's SO_REUSEPORT group."""
    import uvicorn

    _die_with(parent)

    sock = socket.socket(_family(host))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        print(f"API worker cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        sys.exit(STARTUP_FAILURE)
    config = uvicorn.Config(
        app,
        factory=True,
        host=host,
        port=port,
        access_log=False,
        log_config=UVICORN_LOG_CONFIG,
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except Exception:
        if server.started:
            raise
        traceback.print_exc()
        sys.exit(STARTUP_FAILURE)  # the app or its settings: a replacement would fail too
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def _die_with(parent: int) -> None:
    """SIGTERM this worker when the serve process dies, however it dies. A SIGKILLed parent
    (the OOM killer, `kill -9`) otherwise left its workers holding the port: the restarted
    server could not listen, and the orphans answered with no reconciler behind them."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        log.warning(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}")
    if os.getppid() != parent:  # it died before the signal was armed
        sys.exit(0)


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

    from contracts.logs import configure_logging
    from supervisor.api.app import create_app
    from supervisor.settings import Settings

    configure_logging()
    return create_app(Settings.from_env(), metrics_dir=Path(os.environ[METRICS_DIR_ENV]))
