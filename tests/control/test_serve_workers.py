"""`nightwatch serve --workers 2` as a real process tree: the API answers from two processes
that share the SQLite database (idempotency holds across them), and /metrics is one
supervisor's: request counts summed over the workers, the reconciler's metrics once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor import store
from supervisor.api import workers_mode
from supervisor.api.examples import TINY_SPEC
from supervisor.auth import Scope
from supervisor.db import Database
from worker.local_launch import free_port

from .test_idempotency_live import RETRIES, _burst

REPO = Path(__file__).resolve().parents[2]
HEALTH_CHECKS = 40
#: Connections opened at once, and how often: a fair split of 64 falls outside 16-48 with
#: p ≈ 6e-5 (3e-4 in five rounds).
SPREAD_CONNECTIONS = 64
SPREAD_ROUNDS = 5


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, str, psutil.Process]]:
    home = tmp_path / "home"
    db = Database(f"sqlite:///{home / 'nightwatch.db'}")
    db.upgrade()
    with db.write_session() as s:
        token = store.create_token(s, "ci", [Scope.SUBMIT])[1]
    db.dispose()
    port = free_port()
    env = {
        **os.environ, "NIGHTWATCH_HOME": str(home), "NIGHTWATCH_PORT": str(port),
        "NIGHTWATCH_EXECUTOR": "local", "NIGHTWATCH_TICK_SECONDS": "60",
    }  # fmt: skip
    env.pop("NIGHTWATCH_DATABASE_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "serve", "--workers", "2"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with suppress(httpx.TransportError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.2)
        yield url, token, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    families = list(text_string_to_metric_families(httpx.get(f"{url}/metrics").text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), f"metric families exported twice: {names}"
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in families}


def _healthz_count(url: str) -> float:
    return sum(
        v
        for labels, v in _scrape(url)["nightwatch_supervisor_http_requests"]
        if labels.get("route") == "/healthz" and labels.get("status") == "200"
    )


def test_two_api_processes_make_one_supervisor(
    server: tuple[str, str, psutil.Process],
) -> None:
    url, token, parent = server
    assert len(_workers(parent)) >= 2, parent.children(recursive=True)  # uvicorn's two workers

    before = _healthz_count(url)
    for _ in range(HEALTH_CHECKS):  # a new connection each: the kernel spreads them
        assert httpx.get(f"{url}/healthz").status_code == 200
    assert _healthz_count(url) - before == HEALTH_CHECKS  # each once, whichever worker answered
    assert "nightwatch_supervisor_last_tick_timestamp_seconds" in _scrape(url)  # the reconciler's

    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": "ci-build-4712"}
    responses = asyncio.run(_burst(url, headers, [TINY_SPEC] * RETRIES))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * (RETRIES - 1) + [201], codes
    assert len({r.json()["id"] for r in responses}) == 1
    runs = dict((labels["state"], v) for labels, v in _scrape(url)["nightwatch_supervisor_runs"])
    assert runs["pending"] == 1 and sum(runs.values()) == 1, runs


def _workers(parent: psutil.Process) -> list[psutil.Process]:
    return [p for p in parent.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def test_a_killed_serve_takes_its_workers_along(
    server: tuple[str, str, psutil.Process],
) -> None:
    """SIGKILL gives the parent no chance to stop its workers: they must go by themselves and
    free the port, or the restarted server cannot listen."""
    url, _, parent = server
    workers = _workers(parent)
    assert len(workers) >= 2
    parent.kill()
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    port = int(url.rsplit(":", 1)[1])
    workers_mode._check_free("127.0.0.1", port)  # raises OSError while anything holds it


def _sockets_per_worker(parent: psutil.Process, port: int, status: str) -> dict[int, int]:
    """Sockets on the API port in `status` (LISTEN, ESTABLISHED) held by each worker process."""
    wanted = (port, status)
    return {
        w.pid: sum(1 for c in w.net_connections("tcp") if (c.laddr.port, c.status) == wanted)
        for w in _workers(parent)
    }


def test_keep_alive_connections_are_spread_over_the_workers(
    server: tuple[str, str, psutil.Process],
) -> None:
    """A fleet of keep-alive clients connecting at once lands on every worker: with one shared
    listening socket the first worker to wake accepted most of them, kept them for good and ran
    at 90 % of its core while the other idled, which set the p99 under load."""
    url, _, parent = server
    port = int(url.rsplit(":", 1)[1])
    deadline = time.monotonic() + 60  # /healthz answered: one worker is up, maybe not both
    while sorted(_sockets_per_worker(parent, port, "LISTEN").values()) != [1, 1]:
        assert time.monotonic() < deadline, _sockets_per_worker(parent, port, "LISTEN")
        time.sleep(0.2)

    async def hold(n: int) -> dict[int, int]:
        """Open n connections one after the other (as a client's pool fills), then send a
        request on each, so that every one has been accepted when they are counted."""
        streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
        request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        try:
            for _, writer in streams:
                writer.write(request)
            answers = await asyncio.gather(*(r.readuntil(b"\r\n\r\n") for r, _ in streams))
            assert all(a.startswith(b"HTTP/1.1 200") for a in answers)
            return _sockets_per_worker(parent, port, "ESTABLISHED")
        finally:
            for _, writer in streams:
                writer.close()
            await asyncio.gather(*(w.wait_closed() for _, w in streams))
            await asyncio.sleep(0.5)  # the workers see the clients go

    fair = range(SPREAD_CONNECTIONS // 4, 3 * SPREAD_CONNECTIONS // 4 + 1)
    for _ in range(SPREAD_ROUNDS):
        held = asyncio.run(hold(SPREAD_CONNECTIONS))
        assert sum(held.values()) == SPREAD_CONNECTIONS, held
        assert all(n in fair for n in held.values()), held


def app_that_cannot_start() -> None:
    """A worker's app factory whose settings are broken (it runs in the spawned worker)."""
    raise RuntimeError("NIGHTWATCH_SOMETHING is not a number")


def test_a_worker_that_cannot_start_stops_serve_instead_of_respawning() -> None:
    started = time.monotonic()
    with pytest.raises(workers_mode.WorkerStartupFailed, match="failed to start"):
        workers_mode.serve("127.0.0.1", free_port(), 2, app=f"{__name__}:app_that_cannot_start")
    assert time.monotonic() - started < 60
