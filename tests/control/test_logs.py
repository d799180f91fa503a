"""A run's logs over the API (`GET /v1/runs/{id}/logs`) and the CLI (`nightwatch logs`):
tail, per node, follow by offset, and --follow across attempts until the run ends."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from typer.testing import CliRunner

from contracts.paths import attempt_log_dir
from contracts.spec import RunSpec
from supervisor import store
from supervisor.cli import app
from supervisor.db import Database
from supervisor.models import RunState
from supervisor.settings import Settings

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run_with_attempt(
    database: Database, job_id: str | None, nodes: list[str], run_id: str | None = None
) -> tuple[str, int]:
    with database.write_session() as s:
        if run_id is None:
            run, _ = store.create_run(s, RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml"))
            run_id = run.id
        attempt = store.create_attempt(s, run_id, executor="slurm", job_id=job_id)
        if nodes:
            store.update_attempt(s, run_id, attempt.number, nodes_json=nodes)
        return run_id, attempt.number


def _log(home: Path, run_id: str, attempt: int, job_id: str, task: int) -> Path:
    path = attempt_log_dir(home, run_id, attempt) / job_id / f"{job_id}_{task}_log.out"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _end(database: Database, run_id: str, attempt: int) -> None:
    with database.write_session() as s:
        store.update_attempt(s, run_id, attempt, ended_at=datetime.now(UTC))


def test_tail_per_node_and_follow_by_offset(
    client: TestClient, tokens: Any, database: Database, app_settings: Settings
) -> None:
    run_id, number = _run_with_attempt(database, "4242", ["n1", "n2"])
    first = _log(app_settings.home, run_id, number, "4242", 0)
    first.write_text("".join(f"rank0 line {i}\n" for i in range(10)))
    _log(app_settings.home, run_id, number, "4242", 1).write_text("rank2 on n2\n")
    url, headers = f"/v1/runs/{run_id}/logs", tokens.headers("read")

    tail = client.get(url, params={"tail": 3}, headers=headers).json()
    assert tail["text"] == "rank0 line 7\nrank0 line 8\nrank0 line 9\n"
    assert (tail["node"], tail["nodes"], tail["job_id"], tail["done"]) == (
        "n1", ["n1", "n2"], "4242", False)  # fmt: skip
    assert tail["offset"] == first.stat().st_size
    other = client.get(url, params={"node": "n2"}, headers=headers).json()
    assert other["text"] == "rank2 on n2\n"

    with first.open("a") as fh:
        fh.write("rank0 line 10\nrank0 line 11\n")
    more = client.get(url, params={"offset": tail["offset"]}, headers=headers).json()
    assert more["text"] == "rank0 line 10\nrank0 line 11\n"
    again = client.get(url, params={"offset": more["offset"]}, headers=headers).json()
    assert again["text"] == "" and again["offset"] == more["offset"]
    _end(database, run_id, number)
    assert client.get(url, params={"offset": more["offset"]}, headers=headers).json()["done"]


def test_unknown_attempt_or_node_is_404_and_a_job_not_yet_submitted_reads_empty(
    client: TestClient, tokens: Any, database: Database
) -> None:
    run_id, number = _run_with_attempt(database, None, [])
    url, headers = f"/v1/runs/{run_id}/logs", tokens.headers("read")
    empty = client.get(url, headers=headers).json()
    assert (empty["text"], empty["node"], empty["nodes"], empty["job_id"]) == ("", None, [], None)
    missing = client.get(url, params={"attempt": number + 1}, headers=headers)
    assert missing.status_code == 404 and f"no attempt {number + 1}" in missing.json()["message"]
    _run_with_attempt(database, "77", ["n1"], run_id)
    stranger = client.get(url, params={"node": "n9"}, headers=headers)
    assert stranger.status_code == 404 and "n9" in stranger.json()["message"]
    assert client.get(url, params={"node": "bad name!"}, headers=headers).status_code == 422
    assert client.get(url).status_code == 401
    assert client.get("/v1/runs/r-000000000000/logs", headers=headers).status_code == 404


def test_cli_follows_attempt_after_attempt_until_the_run_ends(
    live_server: Any, tokens: Any, database: Database, app_settings: Settings
) -> None:
    run_id, first = _run_with_attempt(database, "100", ["n1"])
    _log(app_settings.home, run_id, first, "100", 0).write_text("attempt one\n")
    _end(database, run_id, first)

    def second_attempt_then_success() -> None:
        threading.Event().wait(0.5)
        _, second = _run_with_attempt(database, "101", ["n2"], run_id)
        log = _log(app_settings.home, run_id, second, "101", 0)
        log.write_text("attempt two starts\n")
        threading.Event().wait(0.5)
        with log.open("a") as fh:
            fh.write("attempt two ends\n")
        _end(database, run_id, second)
        with database.write_session() as s:
            for state in (RunState.SUBMITTED, RunState.RUNNING, RunState.SUCCEEDED):
                store.transition_run(s, run_id, state)

    writer = threading.Thread(target=second_attempt_then_success)
    writer.start()
    env = {"NIGHTWATCH_URL": live_server.url, "NIGHTWATCH_TOKEN": tokens.read}
    result = CliRunner().invoke(
        app, ["logs", run_id, "--follow", "--poll-seconds", "0.1"], env=env,
        catch_exceptions=False,
    )  # fmt: skip
    writer.join()
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "attempt one\n--- attempt 2 ---\nattempt two starts\nattempt two ends\n"
    )


def test_a_follower_that_started_before_slurm_named_the_nodes_keeps_its_place(
    client: TestClient, tokens: Any, database: Database, app_settings: Settings
) -> None:
    run_id, number = _run_with_attempt(database, "88", [])
    log = _log(app_settings.home, run_id, number, "88", 0)
    log.write_text("early\n")
    url, headers = f"/v1/runs/{run_id}/logs", tokens.headers("read")
    first = client.get(url, headers=headers).json()
    assert (first["node"], first["text"]) == ("task0", "early\n")
    with database.write_session() as s:
        store.update_attempt(s, run_id, number, nodes_json=["n7"])
    with log.open("a") as fh:
        fh.write("later\n")
    more = client.get(url, params={"node": "task0", "offset": first["offset"]}, headers=headers)
    assert more.status_code == 200
    assert (more.json()["node"], more.json()["text"]) == ("n7", "later\n")
