"""Nodes over the API (`GET /v1/nodes`, `POST /v1/nodes/{node}/exclude|restore`, admin) and
the CLI (`nightwatch nodes`, `nightwatch node exclude|restore`), carried out by a real
reconciler on the local executor. What the next submission passes to SLURM is tested with a
fake SLURM in tests/watchdog/test_watchdog_nodes.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from contracts.spec import RunSpec
from supervisor import store
from supervisor.cli import app
from supervisor.db import Database
from supervisor.settings import Settings
from supervisor.slurm import LocalCluster
from supervisor.watchdog.reconciler import build_reconciler

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _attempt_on(database: Database, *nodes: str) -> str:
    with database.write_session() as s:
        run, _ = store.create_run(s, RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml"))
        store.create_attempt(s, run.id, executor="slurm", job_id="7")
        store.update_attempt(s, run.id, 1, nodes_json=list(nodes))
        return run.id


def test_nodes_are_read_by_all_and_excluded_or_restored_by_admin_only(
    client: TestClient, tokens: Any, database: Database
) -> None:
    _attempt_on(database, "n1", "n2")
    listed = client.get("/v1/nodes", headers=tokens.headers("read"))
    assert listed.status_code == 200
    assert [(n["name"], n["health"], n["excluded"]) for n in listed.json()["items"]] == [
        ("n1", "healthy", False), ("n2", "healthy", False)]  # fmt: skip
    for scope in ("read", "submit"):
        refused = client.post("/v1/nodes/n2/exclude", headers=tokens.headers(scope))
        assert refused.status_code == 403 and "lacks scope 'admin'" in refused.json()["message"]
    admin = tokens.headers("admin")
    done = client.post("/v1/nodes/n2/exclude", json={"reason": "xid 79"}, headers=admin)
    assert done.status_code == 202
    assert done.json()["pending"] == {**done.json()["pending"], "kind": "exclude",
                                      "requested_by": "test-admin", "reason": "xid 79"}  # fmt: skip
    again = client.post("/v1/nodes/n2/exclude", headers=admin)
    assert again.status_code == 409 and "pending exclude" in again.json()["message"]
    assert client.post("/v1/nodes/n1/restore", headers=admin).status_code == 409
    unknown = client.post("/v1/nodes/n9/exclude", headers=admin)
    assert unknown.status_code == 404 and "n9 is not known" in unknown.json()["message"]
    assert client.get("/v1/nodes/n9", headers=tokens.headers("read")).status_code == 404
    assert client.post("/v1/nodes/-bad/exclude", headers=admin).status_code == 422
    too_long = client.post("/v1/nodes/n1/exclude", json={"reason": "x" * 501}, headers=admin)
    assert too_long.status_code == 422
    garbled = client.post("/v1/nodes/n1/exclude", content=b"{", headers={
        **admin, "Content-Type": "application/json"})  # fmt: skip
    assert garbled.status_code == 400
    detail = client.get("/v1/nodes/n2", headers=tokens.headers("read")).json()
    assert [(a["kind"], a["state"]) for a in detail["actions"]] == [("exclude", "intent")]


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_node_exclude_and_restore_from_the_cli_through_a_real_reconciler(
    live_server: Any, tokens: Any, database: Database, app_settings: Settings
) -> None:
    _attempt_on(database, "n1", "n2")
    reconciler = build_reconciler(app_settings, database, cluster=LocalCluster())
    runner = CliRunner()
    env = {"NIGHTWATCH_URL": live_server.url, "NIGHTWATCH_TOKEN": tokens.admin}

    def cli(*args: str, token: str = tokens.admin) -> Any:
        return runner.invoke(app, list(args), env={**env, "NIGHTWATCH_TOKEN": token})

    refused = cli("node", "exclude", "n2", token=tokens.submit)
    assert refused.exit_code == 1 and "HTTP 403" in refused.stderr
    excluded = cli("node", "exclude", "n2", "--reason", "xid 79")
    assert excluded.exit_code == 0 and "exclusion requested" in excluded.stdout
    reconciler.tick()
    table = cli("nodes", token=tokens.read).stdout.splitlines()
    assert table[0].split()[:4] == ["NODE", "HEALTH", "STRIKES", "FLEET"]
    row = next(line for line in table if line.startswith("n2 "))
    assert row.split()[:4] == ["n2", "excluded", "0", "excluded"]
    assert row.endswith("exclude by test-admin: xid 79")
    (n2,) = [n for n in json.loads(cli("nodes", "--json").stdout)["items"] if n["name"] == "n2"]
    assert (n2["excluded"], n2["excluded_by"], n2["pending"]) == (True, "test-admin", None)
    with database.session() as s:
        assert store.fleet_excluded_nodes(s) == {"n2"}

    assert cli("node", "restore", "n2").exit_code == 0
    reconciler.tick()
    (n2,) = [n for n in json.loads(cli("nodes", "--json").stdout)["items"] if n["name"] == "n2"]
    assert (n2["excluded"], n2["health"]) == (False, "healthy")
    twice = cli("node", "restore", "n2")
    assert twice.exit_code == 1 and "HTTP 409" in twice.stderr and "nothing to restore" in (
        twice.stderr)  # fmt: skip
    assert "HTTP 404" in cli("node", "exclude", "n9").stderr
