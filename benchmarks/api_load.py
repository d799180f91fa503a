"""Load test of the control-plane API: POST /v1/runs and GET /v1/runs/{id} at concurrency 32.

The server runs as a separate process (`python -m supervisor.cli serve --no-reconciler`, so
the stored runs are not launched) on 127.0.0.1 with a fresh SQLite file or a fresh PostgreSQL
database; this process is the client (asyncio + httpx).
Closed loop by default (as fast as 32 clients go); `--rate R` paces requests at R/s and measures
latency from each request's scheduled start, so a stalled server cannot hide its queueing.

    .venv/bin/python benchmarks/api_load.py --db sqlite --db postgresql --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from supervisor import store  # noqa: E402
from supervisor.api.examples import TINY_SPEC  # noqa: E402
from supervisor.auth import Scope  # noqa: E402
from supervisor.db import Database  # noqa: E402

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@dataclass
class Result:
    db: str
    op: str
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    server_cpu_ms: float
    """Server process CPU time per request: what one request costs, whatever the load."""

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _database(kind: str) -> Iterator[str]:
    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as home:
            yield f"sqlite:///{home}/nightwatch.db"
        return
    name = f"nw_bench_{secrets.token_hex(4)}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def _server(url: str) -> Iterator[tuple[str, str, psutil.Process]]:
    """Migrate, mint a token, start `serve` in its own process; yield (URL, token, process)."""
    db = Database(url)
    db.upgrade()
    with db.write_session() as session:
        _, secret = store.create_token(session, "bench", [Scope.SUBMIT])
    db.dispose()
    port = _free_port()
    home = tempfile.mkdtemp()
    env = {**os.environ, "NIGHTWATCH_DATABASE_URL": url, "NIGHTWATCH_HOME": home,
           "NIGHTWATCH_PORT": str(port)}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "serve", "--no-reconciler"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.1)
        yield base, secret, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=15)


async def _phase(
    base: str,
    token: str,
    op: str,
    seconds: float,
    concurrency: int,
    rate: float | None,
    run_ids: list[str],
) -> tuple[list[float], int, float]:
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    latencies: list[float] = []
    errors = 0
    counter = 0
    start = time.perf_counter()

    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=30) as c:

        async def worker() -> None:
            nonlocal errors, counter
            while True:
                i = counter
                counter += 1
                scheduled = start + i / rate if rate else time.perf_counter()
                if scheduled - start > seconds:
                    return
                delay = scheduled - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if op == "POST":
                    response = await c.post(
                        "/v1/runs", json=TINY_SPEC, headers={"Idempotency-Key": str(uuid.uuid4())}
                    )
                    if response.status_code == 201:
                        run_ids.append(response.json()["id"])
                else:
                    response = await c.get(f"/v1/runs/{run_ids[i % len(run_ids)]}")
                latencies.append(time.perf_counter() - scheduled)
                errors += response.status_code >= 400

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, errors, time.perf_counter() - start


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1]


def bench(kind: str, seconds: float, concurrency: int, rate: float | None) -> list[Result]:
    results = []
    with _database(kind) as url, _server(url) as (base, token, server):
        run_ids: list[str] = []
        asyncio.run(_phase(base, token, "POST", 1.0, concurrency, None, run_ids))  # warm-up
        for op in ("POST", "GET"):
            cpu_before = sum(server.cpu_times()[:2])
            lat, errors, elapsed = asyncio.run(
                _phase(base, token, op, seconds, concurrency, rate, run_ids)
            )
            cpu_ms = 1000 * (sum(server.cpu_times()[:2]) - cpu_before) / len(lat)
            p50, p99 = (1000 * _percentile(lat, q) for q in (0.5, 0.99))
            results.append(Result(kind, op, len(lat), errors, elapsed, p50, p99, cpu_ms))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", action="append", choices=["sqlite", "postgresql"])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate", type=float, default=None, help="Requests/s (open loop).")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [r for kind in args.db or ["sqlite", "postgresql"]
            for r in bench(kind, args.seconds, args.concurrency, args.rate)]  # fmt: skip
    if args.json:
        print(json.dumps([{**r.__dict__, "rps": r.rps} for r in rows], indent=2))
        return
    mode = f"open loop at {args.rate:g} req/s" if args.rate else "closed loop"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"concurrency {args.concurrency}, {mode}, {args.seconds:g} s per phase, "
          f"{os.cpu_count()} CPUs, load average after the run {load}")  # fmt: skip
    print("| database | request | requests | errors | throughput (req/s) | p50 (ms) | p99 (ms) "
          "| server CPU per request (ms) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.db} | {r.op} | {r.requests} | {r.errors} | {r.rps:.0f} | "
              f"{r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.server_cpu_ms:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
