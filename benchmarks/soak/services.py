"""The real stack the soak runs on: devcluster (SLURM + Prometheus), PostgreSQL, supervisor.

Every server listens on 127.0.0.1. The soak owns its own cluster directory and port range, its
own PostgreSQL database and its own supervisor process (so it can SIGKILL and restart it), and
stops all of them at the end, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from supervisor import store
from supervisor.auth import Scope
from supervisor.db import Database
from worker.local_launch import free_port

REPO = Path(__file__).resolve().parents[2]
DEVCLUSTER = REPO / "scripts" / "devcluster"
PYTHON = sys.executable


def wait_until(what: str, check, timeout_s: float, interval_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@dataclass
class Cluster:
    """A devcluster of its own (directory + port range), driven through the project script."""

    root: Path
    nodes: int
    base_port: int
    #: SLURM's accounting (slurmdbd and MariaDB); without it, where MariaDB is missing (the lent
    #: GPU machines), finished jobs stay in squeue for an hour (`MinJobAge`), longer than a soak.
    accounting: bool = True

    def run(self, *args: str, timeout_s: float = 120) -> str:
        cmd = [PYTHON, str(DEVCLUSTER), "--dir", str(self.root), "--base-port", str(self.base_port)]
        out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"devcluster {' '.join(args)}: {out.stderr.strip()[-800:]}")
        return out.stdout

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.root / "etc" / "slurm.conf")}

    @property
    def slurm_conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.base_port + 3}"

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(f"n{i}" for i in range(1, self.nodes + 1))

    def start(self, sd_url: str | None = None, sd_token: str | None = None) -> None:
        args = ["start", "--nodes", str(self.nodes), *self._accounting_args]
        if sd_url:
            args += ["--sd-url", sd_url, "--sd-token", sd_token or ""]
        self.run(*args)

    def restart_prometheus(self, sd_url: str, sd_token: str) -> None:
        self.run("prometheus", "--sd-url", sd_url, "--sd-token", sd_token)

    def stop_prometheus(self) -> None:
        _terminate(self.root / "prometheus" / "prometheus.pid")

    def stop_slurmctld(self) -> None:
        _terminate(self.root / "run" / "slurmctld.pid")

    def start_slurm_only(self) -> None:
        """Idempotent start without touching Prometheus (brings a stopped slurmctld back)."""
        self.run("start", "--nodes", str(self.nodes), "--no-prometheus", *self._accounting_args)

    @property
    def _accounting_args(self) -> list[str]:
        return [] if self.accounting else ["--no-accounting"]

    def kill_node(self, node: str) -> None:
        self.run("kill-node", node)

    def revive_node(self, node: str) -> None:
        self.run("revive-node", node)

    def stop(self) -> None:
        self.run("stop")


def _terminate(pidfile: Path, timeout_s: float = 15.0) -> None:
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def create_database(name: str, admin_url: str = PG_ADMIN_URL) -> str:
    """A fresh PostgreSQL database for this soak; returns its SQLAlchemy URL. Name it per
    soak process: a supervisor left over from an interrupted soak reconnects to a database
    of the same name and, holding the reconciler lease, would take the new run over."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def drop_database(name: str, admin_url: str = PG_ADMIN_URL) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Supervisor:
    """`nightwatch serve` (API + reconciler in one process), started as a child so the soak
    can SIGKILL it and start it again on the same database."""

    home: Path
    database_url: str
    prometheus_url: str
    slurm_conf: Path
    #: Where the soak's prepared corpus lives (outside home): the API's data root.
    data_root: Path | None = None
    port: int = field(default_factory=free_port)
    tick_seconds: float = 2.0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        roots = {"NIGHTWATCH_DATA_ROOTS": str(self.data_root)} if self.data_root else {}
        return {
            **os.environ,
            **roots,
            "NIGHTWATCH_HOME": str(self.home),
            "NIGHTWATCH_DATABASE_URL": self.database_url,
            "NIGHTWATCH_PROMETHEUS_URL": self.prometheus_url,
            "NIGHTWATCH_PUBLIC_URL": self.url,
            "NIGHTWATCH_PORT": str(self.port),
            "NIGHTWATCH_HOST": "127.0.0.1",
            "NIGHTWATCH_TICK_SECONDS": str(self.tick_seconds),
            "NIGHTWATCH_EXECUTOR": "slurm",
            "SLURM_CONF": str(self.slurm_conf),
            "PYTHONPATH": str(REPO),
        }

    def database(self) -> Database:
        db = Database(self.database_url)
        db.upgrade()
        return db

    def token(self, name: str, scopes: list[Scope]) -> str:
        db = self.database()
        try:
            with db.write_session() as s:
                _, secret = store.create_token(s, name, scopes)
        finally:
            db.dispose()
        return secret

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        log = (self.home / "supervisor.log").open("ab")
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "supervisor.cli", "serve"],
            cwd=REPO,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_until("the supervisor API", self._healthy, timeout_s=90)

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"supervisor exited {self.proc.returncode}; see supervisor.log")
        with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as resp:
            return resp.status == 200

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no flushing; the point of the fault."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
