"""Load test of the control-plane API: POST /v1/runs and GET /v1/runs/{id} at concurrency 32.

Three phases: only POSTs, only GETs, then MIX (one POST in ten, the rest GETs).

The server runs as a separate process (`python -m supervisor.cli serve --no-reconciler`, so
the stored runs are not launched) on 127.0.0.1 with a fresh SQLite file or a fresh PostgreSQL
database; this process is the client (asyncio streams, keep-alive HTTP/1.1; see `_Connection`).
Closed loop by default (as fast as 32 clients go); `--rate R` paces requests at R/s and measures
latency from each request's scheduled start, so a stalled server cannot hide its queueing.

    .venv/bin/python benchmarks/api_load.py --db sqlite --db postgresql --seconds 10
    .venv/bin/python benchmarks/api_load.py --seconds 8 --rate 500 --workers 2
    .venv/bin/python benchmarks/api_load.py --db sqlite --sqlite-synchronous normal \
        --sqlite-synchronous full --rate 500      # the cost of durable commits, side by side
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import secrets
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
from worker.local_launch import free_port  # noqa: E402

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
SERVE = [sys.executable, "-m", "supervisor.cli", "serve", "--no-reconciler"]
#: The third phase: what a CI fleet and its dashboards send, one submission per ten reads.
MIX_POST_EVERY = 10
MIX = "MIX"


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
    client_cpu_ms: float
    """This process's CPU time per request: the load generator's share of the 2 cores."""
    steal_pct: float
    """CPU time the VM's host took from this machine during the phase (% of all CPUs): a
    neighbour's load that can inflate the tail without any change here."""
    connections_opened: int | None
    """PostgreSQL sessions opened during the phase (each forks a backend); None on SQLite."""

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


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
def _server(url: str, workers: int, synchronous: str) -> Iterator[tuple[str, str, psutil.Process]]:
    """Migrate, mint a token, start `serve` in its own process; yield (URL, token, process)."""
    db = Database(url)
    db.upgrade()
    with db.write_session() as session:
        _, secret = store.create_token(session, "bench", [Scope.SUBMIT])
    db.dispose()
    port = free_port()
    home = tempfile.mkdtemp()
    env = {**os.environ, "NIGHTWATCH_DATABASE_URL": url, "NIGHTWATCH_HOME": home,
           "NIGHTWATCH_PORT": str(port), "NIGHTWATCH_SQLITE_SYNCHRONOUS": synchronous}  # fmt: skip
    proc = subprocess.Popen(
        [*SERVE, "--workers", str(workers)],
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


class _Connection:
    """One keep-alive HTTP/1.1 connection on asyncio streams.

    The load generator must cost far less than the server, or on 2 cores it measures itself:
    httpx spends ≈ 3 ms of CPU per request here (more than the server's 1.5-2.5 ms), this
    ≈ 0.1 ms. The server always answers with Content-Length, which is all this parses.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, base: str) -> _Connection:
        host, port = base.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def request(self, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
        self.writer.write(head + body)
        header = await self.reader.readuntil(b"\r\n\r\n")
        status = int(header[9:12])
        length = 0
        for line in header.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def _head(method: str, path: str, token: str, extra: str = "", length: int = 0) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n{extra}\r\n"
    ).encode()


async def _phase(
    base: str,
    token: str,
    op: str,
    seconds: float,
    concurrency: int,
    rate: float | None,
    run_ids: list[str],
) -> tuple[list[float], int, float]:
    """`concurrency` connections; with `rate`, request i is due at start + i/rate (open loop,
    latency counted from then), else each connection sends as soon as its answer is in."""
    body = json.dumps(TINY_SPEC).encode()
    latencies: list[float] = []
    errors = 0
    counter = 0
    connections = [await _Connection.open(base) for _ in range(concurrency)]
    start = time.perf_counter()

    async def worker(conn: _Connection) -> None:
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
            if op == "POST" or (op == MIX and i % MIX_POST_EVERY == 0):
                key = f"Idempotency-Key: {uuid.uuid4()}\r\n"
                status, answer = await conn.request(
                    _head("POST", "/v1/runs", token, key, len(body)), body
                )
                if status == 201:
                    run_ids.append(json.loads(answer)["id"])
            else:
                path = f"/v1/runs/{run_ids[i % len(run_ids)]}"
                status, _ = await conn.request(_head("GET", path, token))
            latencies.append(time.perf_counter() - scheduled)
            errors += status >= 400

    try:
        await asyncio.gather(*(worker(c) for c in connections))
    finally:
        for c in connections:
            c.close()
    return latencies, errors, time.perf_counter() - start


def _cpu(server: psutil.Process) -> float:
    """CPU seconds of the server and its children (`--workers N` serves from child processes)."""
    procs = [server, *server.children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _sessions(url: str) -> int | None:
    """PostgreSQL sessions ever opened to the benchmark's database (pg_stat_database)."""
    if not url.startswith("postgresql"):
        return None
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        row = admin.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = %s", (name,)
        ).fetchone()
    return int(row[0]) if row else None


def _steal() -> float:
    return psutil.cpu_times().steal


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1]


def bench(
    kind: str,
    seconds: float,
    concurrency: int,
    rate: float | None,
    workers: int,
    synchronous: str = "full",
) -> list[Result]:
    results = []
    label = f"{kind} ({synchronous})" if kind == "sqlite" else kind
    with _database(kind) as url, _server(url, workers, synchronous) as (base, token, server):
        run_ids: list[str] = []
        asyncio.run(_phase(base, token, "POST", 1.0, concurrency, None, run_ids))  # warm-up
        for op in ("POST", "GET", MIX):
            cpu_before, client_before = _cpu(server), time.process_time()
            steal_before, sessions_before = _steal(), _sessions(url)
            lat, errors, elapsed = asyncio.run(
                _phase(base, token, op, seconds, concurrency, rate, run_ids)
            )
            cpu_ms = 1000 * (_cpu(server) - cpu_before) / len(lat)
            client_ms = 1000 * (time.process_time() - client_before) / len(lat)
            steal = 100 * (_steal() - steal_before) / (elapsed * (os.cpu_count() or 1))
            sessions_after = _sessions(url)
            opened = None if sessions_before is None else sessions_after - sessions_before
            p50, p99 = (1000 * _percentile(lat, q) for q in (0.5, 0.99))
            results.append(
                Result(
                    label, op, len(lat), errors, elapsed, p50, p99, cpu_ms, client_ms, steal, opened
                )
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", action="append", choices=["sqlite", "postgresql"])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate", type=float, default=None, help="Requests/s (open loop).")
    parser.add_argument("--workers", type=int, default=1, help="`serve --workers`.")
    parser.add_argument(
        "--sqlite-synchronous",
        action="append",
        choices=["full", "normal"],
        help="SQLite's synchronous level (default full); repeat to compare side by side.",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    run = functools.partial(
        bench, seconds=args.seconds, concurrency=args.concurrency, rate=args.rate,
        workers=args.workers,
    )  # fmt: skip
    levels = args.sqlite_synchronous or ["full"]
    rows = [
        r
        for kind in args.db or ["sqlite", "postgresql"]
        for level in (levels if kind == "sqlite" else ["full"])
        for r in run(kind, synchronous=level)
    ]
    if args.json:
        print(json.dumps([{**r.__dict__, "rps": r.rps} for r in rows], indent=2))
        return
    mode = f"open loop at {args.rate:g} req/s" if args.rate else "closed loop"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{args.workers} server process(es), concurrency {args.concurrency}, {mode}, "
          f"{args.seconds:g} s per phase, "
          f"{os.cpu_count()} CPUs, load average after the run {load}")  # fmt: skip
    print("| database | request | requests | errors | throughput (req/s) | p50 (ms) | p99 (ms) "
          "| server CPU per request (ms) | client CPU per request (ms) | steal (%) "
          "| connections opened |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        opened = "–" if r.connections_opened is None else r.connections_opened
        print(f"| {r.db} | {r.op} | {r.requests} | {r.errors} | {r.rps:.0f} | "
              f"{r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.server_cpu_ms:.2f} "
              f"| {r.client_cpu_ms:.2f} | {r.steal_pct:.1f} | {opened} |")  # fmt: skip


if __name__ == "__main__":
    main()
