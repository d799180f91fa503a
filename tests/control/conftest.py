"""Fixtures for the control plane: apps, tokens, servers (databases: tests/conftest.py)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from supervisor import store
from supervisor.api.app import create_app
from supervisor.auth import Scope
from supervisor.db import Database
from supervisor.settings import Settings

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass
class Tokens:
    read: str
    submit: str
    admin: str

    def headers(self, scope: str = "submit") -> dict[str, str]:
        return {"Authorization": f"Bearer {getattr(self, scope)}"}


@pytest.fixture
def tokens(database: Database) -> Tokens:
    with database.write_session() as session:
        secrets_ = {
            scope.value: store.create_token(session, f"test-{scope.value}", [scope])[1]
            for scope in Scope
        }
    return Tokens(**secrets_)


@pytest.fixture
def app_settings(tmp_path: Path) -> Settings:
    """Home in the test's folder; examples/ read their corpora from /datasets (a data root)."""
    return Settings(home=tmp_path / "home", data_roots=(tmp_path / "home", Path("/datasets")))


@pytest.fixture
def client(database: Database, app_settings: Settings) -> Iterator[TestClient]:
    app = create_app(app_settings, database=database, registry=CollectorRegistry())
    with TestClient(app) as c:
        yield c


class LiveServer:
    """uvicorn serving the app on 127.0.0.1 on a free port, in a thread of this process."""

    def __init__(self, app: object) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("live server did not start")

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def live_server(database: Database, app_settings: Settings) -> Iterator[LiveServer]:
    app = create_app(app_settings, database=database, registry=CollectorRegistry())
    with LiveServer(app) as server:
        yield server
