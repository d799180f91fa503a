"""`POST /v1/specs/validate?smoke=true`: off unless the operator turns it on (403 pointing at the
CLI), admin tokens only, one check at a time per host (409), nothing started for a layout that
cannot run; and one real check of a one-rank spec (slow)."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from supervisor.api.app import create_app
from supervisor.db import Database
from supervisor.settings import Settings
from supervisor.smoke.run import one_at_a_time

pytestmark = pytest.mark.parametrize("database", ["sqlite"], indirect=True)

ONE_RANK = {
    "name": "one-rank",
    "model": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 64,
        "vocab_size": 4096,
        "precision": "fp32",
    },
    "resources": {"device": "cpu", "nodes": 1, "gpus_per_node": 1},
    "training": {"train_steps": 10},
}
SMOKE = "/v1/specs/validate?smoke=true"


@pytest.fixture
def smoke_home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def smoke_client(database: Database, smoke_home: Path) -> Iterator[TestClient]:
    settings = Settings(home=smoke_home, allow_smoke_checks=True, smoke_timeout_seconds=240)
    with TestClient(create_app(settings, database=database, registry=CollectorRegistry())) as c:
        yield c


def test_smoke_is_off_unless_the_operator_allows_it(client: TestClient, tokens) -> None:
    response = client.post(SMOKE, json=ONE_RANK, headers=tokens.headers("admin"))
    assert response.status_code == 403
    body = response.json()
    assert body["error"] == "forbidden"
    assert "nightwatch validate SPEC --smoke" in body["message"]
    plain = client.post("/v1/specs/validate", json=ONE_RANK, headers=tokens.headers("read"))
    assert plain.status_code == 200 and plain.json()["smoke"] is None


def test_smoke_needs_admin_and_runs_one_at_a_time(
    smoke_client: TestClient, tokens, smoke_home: Path
) -> None:
    refused = smoke_client.post(SMOKE, json=ONE_RANK, headers=tokens.headers("submit"))
    assert refused.status_code == 403 and "admin" in refused.json()["message"]
    with one_at_a_time(smoke_home / "smoke.lock"):
        busy = smoke_client.post(SMOKE, json=ONE_RANK, headers=tokens.headers("admin"))
    assert busy.status_code == 409 and busy.headers["Retry-After"] == "30"
    assert "already running" in busy.json()["message"]


def test_nothing_is_started_for_a_layout_that_cannot_run(smoke_client: TestClient, tokens) -> None:
    bad = {**ONE_RANK, "parallelism": {"tensor": 3}}
    body = smoke_client.post(SMOKE, json=bad, headers=tokens.headers("admin")).json()
    assert body["ok"] is False and body["smoke"] is None


def _shared_home() -> Path:
    """The training tests' NIGHTWATCH_HOME (tests/train/conftest.py), whose demo corpus is
    usually prepared already."""
    default = Path(tempfile.gettempdir()) / "nightwatch-test-home"
    return Path(os.environ.get("NIGHTWATCH_TEST_HOME", default))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "app_settings",
    [Settings(home=_shared_home(), allow_smoke_checks=True, smoke_timeout_seconds=240)],
)
def test_a_real_smoke_check_leaves_the_server_responsive(live_server, tokens) -> None:
    """While one check trains, /healthz answers at once and a second check gets 409."""
    url, admin = live_server.url, tokens.headers("admin")
    started = time.time()
    answers: list[httpx.Response] = []
    first = threading.Thread(
        target=lambda: answers.append(
            httpx.post(url + SMOKE, json=ONE_RANK, headers=admin, timeout=280)
        )
    )
    first.start()
    work = Path(tempfile.gettempdir())
    while not [p for p in work.glob("nightwatch-smoke-one-rank-*") if p.stat().st_mtime > started]:
        assert first.is_alive(), answers[0].text
        time.sleep(0.1)
    t0 = time.monotonic()
    assert httpx.get(url + "/healthz", timeout=10).status_code == 200
    assert time.monotonic() - t0 < 2.0
    second = httpx.post(url + SMOKE, json=ONE_RANK, headers=admin, timeout=30)
    assert second.status_code == 409, second.text
    first.join(280)
    (response,) = answers
    assert response.status_code == 200, response.text
    smoke = response.json()["smoke"]
    assert smoke["ok"], smoke
    assert (smoke["device"], smoke["ranks"], smoke["phase"]) == ("cpu", 1, None)
    assert smoke["spec"]["training"]["train_steps"] == 3
