"""Who may write to a run, on SQLite and PostgreSQL: its owner or admin; never another owner's
token, never a worker token beyond registering its own run's endpoints; Idempotency-Keys are
the caller's own; a run that ends revokes its worker tokens."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from supervisor import store
from supervisor.api.examples import TINY_SPEC
from supervisor.auth import RunWrite, Scope, run_write_refusal
from supervisor.db import Database
from supervisor.models import RunState

Tokens = Any  # the conftest fixture type
ENDPOINT = {"host": "127.0.0.1", "port": 9400}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
def teams(database: Database) -> dict[str, str]:
    """Secrets of submit tokens: two of team `vision`, one of team `speech`."""
    with database.write_session() as s:
        return {
            name: store.create_token(s, name, [Scope.SUBMIT], owner=owner)[1]
            for name, owner in (("alice", "vision"), ("bob", "vision"), ("carol", "speech"))
        }


def submit(client: TestClient, secret: str, **headers: str) -> Any:
    return client.post("/v1/runs", json=TINY_SPEC, headers={**bearer(secret), **headers})


def running_run(client: TestClient, secret: str, database: Database) -> str:
    run = submit(client, secret).json()["id"]
    with database.write_session() as s:
        store.create_attempt(s, run, executor="local")
        store.transition_run(s, run, RunState.SUBMITTED)
        store.transition_run(s, run, RunState.RUNNING)
    return run


def test_runs_record_their_owner_and_only_the_owner_or_admin_may_cancel(
    client: TestClient, tokens: Tokens, teams: dict[str, str], database: Database
) -> None:
    created = submit(client, teams["alice"]).json()
    assert created["owner"] == "vision"
    run = created["id"]
    for outsider in (teams["carol"], tokens.read):
        refused = client.post(f"/v1/runs/{run}/cancel", headers=bearer(outsider))
        assert refused.status_code == 403, outsider
    assert (
        "belongs to another owner"
        in client.post(f"/v1/runs/{run}/cancel", headers=bearer(teams["carol"])).json()["message"]
    )
    assert client.get(f"/v1/runs/{run}", headers=bearer(teams["carol"])).json()["state"] == (
        "pending"
    )  # refused, and reads stay fleet-wide
    teammate = client.post(f"/v1/runs/{run}/cancel", headers=bearer(teams["bob"]))
    assert teammate.status_code == 200 and teammate.json()["state"] == "cancelled"

    other = submit(client, teams["carol"]).json()["id"]
    by_admin = client.post(f"/v1/runs/{other}/cancel", headers=tokens.headers("admin"))
    assert by_admin.status_code == 200 and by_admin.json()["state"] == "cancelled"
    assert (
        client.post("/v1/runs/r-000000000000/cancel", headers=bearer(teams["carol"])).status_code
        == 404
    )


def test_only_the_owner_admin_or_the_runs_worker_may_register_endpoints(
    client: TestClient, tokens: Tokens, teams: dict[str, str], database: Database
) -> None:
    run = running_run(client, teams["alice"], database)
    url = f"/v1/runs/{run}/attempts/1/endpoints/n1"
    assert client.put(url, json=ENDPOINT, headers=bearer(teams["carol"])).status_code == 403
    for allowed in (teams["bob"], tokens.admin):
        assert client.put(url, json=ENDPOINT, headers=bearer(allowed)).status_code == 204


def test_a_worker_token_never_cancels_and_touches_only_its_run(
    client: TestClient, teams: dict[str, str], database: Database
) -> None:
    run = running_run(client, teams["alice"], database)
    victim = running_run(client, teams["carol"], database)
    with database.write_session() as s:
        _, worker = store.create_token(s, f"worker-{run}-a1", [Scope.SUBMIT], run_id=run)
    for target in (run, victim):
        cancel = client.post(f"/v1/runs/{target}/cancel", headers=bearer(worker))
        assert cancel.status_code == 403, target
    own = client.put(
        f"/v1/runs/{run}/attempts/1/endpoints/n1", json=ENDPOINT, headers=bearer(worker)
    )
    assert own.status_code == 204
    foreign = f"/v1/runs/{victim}/attempts/1/endpoints/n1"
    assert client.put(foreign, json=ENDPOINT, headers=bearer(worker)).status_code == 403
    with database.session() as s:
        assert [store.get_run(s, r).cancel_requested for r in (run, victim)] == [False, False]


def test_idempotency_keys_are_scoped_to_the_owner(
    client: TestClient, teams: dict[str, str]
) -> None:
    key = {"Idempotency-Key": "nightly-42"}
    mine = submit(client, teams["alice"], **key)
    theirs = submit(client, teams["carol"], **key)
    assert (mine.status_code, theirs.status_code) == (201, 201)
    assert mine.json()["id"] != theirs.json()["id"]
    # a teammate shares the owner, so the key names the same run
    again = submit(client, teams["bob"], **key)
    assert again.status_code == 200 and again.json()["id"] == mine.json()["id"]
    other_spec = {**TINY_SPEC, "name": "other"}
    conflict = client.post("/v1/runs", json=other_spec, headers={**bearer(teams["carol"]), **key})
    assert conflict.status_code == 409
    assert theirs.json()["id"] in conflict.json()["message"]
    assert mine.json()["id"] not in conflict.json()["message"]


def test_a_run_that_ends_revokes_its_worker_tokens(
    client: TestClient, teams: dict[str, str], database: Database
) -> None:
    run = running_run(client, teams["alice"], database)
    other = running_run(client, teams["alice"], database)
    with database.write_session() as s:
        _, worker = store.create_token(s, "w1", [Scope.SUBMIT], run_id=run)
        _, bystander = store.create_token(s, "w2", [Scope.SUBMIT], run_id=other)
        store.transition_run(s, run, RunState.NEEDS_ATTENTION)  # not an end: still usable
        assert store.token_for_secret(s, worker) is not None
        store.transition_run(s, run, RunState.FAILED, reason="gave up")
        assert store.token_for_secret(s, worker) is None
        assert store.token_for_secret(s, bystander) is not None


@pytest.mark.parametrize(
    ("caller", "write", "refused"),
    [
        (("submit", "vision", None), RunWrite.CANCEL, False),
        (("submit", "speech", None), RunWrite.CANCEL, True),
        (("admin", "speech", None), RunWrite.CANCEL, False),
        (("read", "vision", None), RunWrite.CANCEL, True),
        (("submit", "vision", "r-1"), RunWrite.CANCEL, True),
        (("admin", "vision", "r-1"), RunWrite.CANCEL, True),
        (("submit", "x", "r-1"), RunWrite.REGISTER_ENDPOINT, False),
        (("submit", "x", "r-2"), RunWrite.REGISTER_ENDPOINT, True),
    ],
)
def test_run_write_policy(
    caller: tuple[str, str, str | None], write: RunWrite, refused: bool
) -> None:
    scope, owner, token_run = caller
    reason = run_write_refusal(
        write, scopes=[scope], owner=owner, token_run_id=token_run, run_id="r-1", run_owner="vision"
    )
    assert (reason is not None) == refused, reason
