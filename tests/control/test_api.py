"""The REST API over SQLite and PostgreSQL: auth, submit, list/filter/page, cancel, events,
spec validation, worker registration, health and metrics."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from supervisor import store
from supervisor.api.examples import TINY_SPEC, TOO_BIG_SPEC
from supervisor.auth import Scope
from supervisor.db import Database
from supervisor.models import EventKind, RunState

Tokens = Any  # the conftest fixture type


def submit(client: TestClient, tokens: Tokens, spec: dict[str, Any] | None = None, **headers: str):
    return client.post("/v1/runs", json=spec or TINY_SPEC, headers={**tokens.headers(), **headers})


def test_missing_or_unknown_token_is_401_and_wrong_scope_is_403(
    client: TestClient, tokens: Tokens
) -> None:
    response = client.get("/v1/runs")
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"] == "unauthorized"
    bogus = client.get("/v1/runs", headers={"Authorization": "Bearer nw_not-a-token"})
    assert bogus.status_code == 401
    read_only = client.post("/v1/runs", json=TINY_SPEC, headers=tokens.headers("read"))
    assert read_only.status_code == 403
    assert "lacks scope 'submit'" in read_only.json()["message"]
    assert client.get("/v1/runs", headers=tokens.headers("read")).status_code == 200
    assert client.get("/v1/runs", headers=tokens.headers("admin")).status_code == 200


def test_revoked_token_is_rejected(client: TestClient, database: Database) -> None:
    with database.write_session() as s:
        token, secret = store.create_token(s, "old", [Scope.ADMIN])
        store.revoke_token(s, token.id)
    response = client.get("/v1/runs", headers={"Authorization": f"Bearer {secret}"})
    assert response.status_code == 401


def test_tokens_are_stored_hashed_and_never_logged(
    client: TestClient, tokens: Tokens, database: Database
) -> None:
    from contracts.logs import JsonFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("nightwatch")  # attach here: configure_logging stops propagation
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        submit(client, tokens)
        client.get("/v1/runs", headers=tokens.headers("read"))
        client.get("/v1/runs", headers={"Authorization": "Bearer nw_wrong-secret"})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x["path"], x["status"]) for x in lines] == [
        ("/v1/runs", 201),
        ("/v1/runs", 200),
        ("/v1/runs", 401),
    ]  # the access log did run
    for secret in (tokens.read, tokens.submit, "nw_wrong-secret"):
        assert secret not in stream.getvalue()
    with database.engine.connect() as conn:
        dump = "\n".join(str(row) for row in conn.exec_driver_sql("SELECT * FROM tokens"))
    assert tokens.submit not in dump and tokens.submit.removeprefix("nw_") not in dump


def test_submit_stores_a_pending_run_with_location(client: TestClient, tokens: Tokens) -> None:
    response = submit(client, tokens)
    assert response.status_code == 201
    run = response.json()
    assert response.headers["location"] == f"/v1/runs/{run['id']}"
    assert run["state"] == "pending" and run["current_attempt"] == 0
    assert run["target_steps"] == 120 and run["spec"]["model"]["hidden_size"] == 64
    fetched = client.get(response.headers["location"], headers=tokens.headers("read")).json()
    assert fetched["id"] == run["id"] and fetched["attempts"] == []


def test_idempotency_key_replays_and_conflicts(client: TestClient, tokens: Tokens) -> None:
    first = submit(client, tokens, **{"Idempotency-Key": "ci-123"})
    # same spec, keys in another order and a default spelled out: still the same request
    same = {**TINY_SPEC, "checkpoint": {"keep_last": 3, "interval_steps": 20, "dir": None}}
    again = submit(client, tokens, same, **{"Idempotency-Key": "ci-123"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    other = submit(client, tokens, {**TINY_SPEC, "name": "other"}, **{"Idempotency-Key": "ci-123"})
    assert other.status_code == 409
    assert first.json()["id"] in other.json()["message"]
    assert client.get("/v1/runs", headers=tokens.headers("read")).json()["total"] == 1


def test_bad_specs_are_422_naming_field_and_numbers(client: TestClient, tokens: Tokens) -> None:
    too_big = submit(client, tokens, TOO_BIG_SPEC)
    assert too_big.status_code == 422
    (problem,) = too_big.json()["problems"]
    assert problem["field"] == "resources.gpu_memory_gib"
    assert "276.9 GB" in problem["message"]

    bad_heads = {**TINY_SPEC, "parallelism": {**TINY_SPEC["parallelism"], "tensor": 3}}
    fields = {p["field"] for p in submit(client, tokens, bad_heads).json()["problems"]}
    assert {"resources", "model.num_attention_heads"} <= fields

    model = {k: v for k, v in TINY_SPEC["model"].items() if k != "num_layers"}
    typo = {**TINY_SPEC, "model": {**model, "num_layer": 4}}
    body = submit(client, tokens, typo).json()
    assert {p["field"] for p in body["problems"]} >= {"model.num_layers", "model.num_layer"}

    for raw in (b"[]", b"null"):  # JSON, but not a spec
        response = client.post(
            "/v1/runs",
            content=raw,
            headers={**tokens.headers(), "Content-Type": "application/json"},
        )
        assert response.status_code == 422, raw
        assert response.json()["error"] == "invalid"
    assert client.get("/v1/runs", headers=tokens.headers()).json()["total"] == 0


def test_undecodable_json_is_400_with_a_message(client: TestClient, tokens: Tokens) -> None:
    """docs/api.md: a body that is not JSON is 400 (FastAPI's default is 422)."""
    for path in ("/v1/runs", "/v1/specs/validate"):
        response = client.post(
            path,
            content=b'{"name": "x",',
            headers={**tokens.headers(), "Content-Type": "application/json"},
        )
        assert response.status_code == 400, path
        body = response.json()
        assert body["error"] == "bad_request"
        assert body["message"].startswith("body is not valid JSON: ")


def test_bodies_over_the_limit_are_413_declared_or_streamed(
    database: Database, tokens: Tokens, tmp_path: Path
) -> None:
    from prometheus_client import CollectorRegistry

    from supervisor.api.app import create_app
    from supervisor.settings import Settings

    limit = len(json.dumps(TINY_SPEC)) + 10
    app = create_app(
        Settings(home=tmp_path, max_body_bytes=limit),
        database=database,
        registry=CollectorRegistry(),
    )
    padded = {**TINY_SPEC, "name": "x" * 64}  # still a valid name, now over the limit
    headers = {**tokens.headers(), "Content-Type": "application/json"}
    with TestClient(app) as c:
        assert c.post("/v1/runs", json=TINY_SPEC, headers=tokens.headers()).status_code == 201
        declared = c.post("/v1/runs", content=json.dumps(padded).encode(), headers=headers)
        streamed = c.post(
            "/v1/runs", content=iter([json.dumps(padded).encode()[:limit], b"x" * 20]),
            headers=headers,
        )  # fmt: skip
        for response in (declared, streamed):
            assert response.status_code == 413
            assert response.json() == {
                "error": "content_too_large",
                "message": f"request body exceeds {limit} bytes",
                "problems": [],
            }
        assert c.get("/v1/runs", headers=tokens.headers("read")).json()["total"] == 1


def test_validate_reports_layout_without_submitting(client: TestClient, tokens: Tokens) -> None:
    report = client.post("/v1/specs/validate", json=TOO_BIG_SPEC, headers=tokens.headers("read"))
    assert report.status_code == 200
    body = report.json()
    assert body["ok"] is False
    assert body["model_states_total_gb"] == 144.25  # 18 B × 8,013,615,104 parameters
    assert body["memory_per_gpu_gb"]["activations"] == 98.42
    assert body["tokens_per_step"] == 8 * 2048
    llama = Path(__file__).resolve().parents[2] / "examples" / "llama-8b-32gpu.yaml"
    import yaml

    ok = client.post(
        "/v1/specs/validate", json=yaml.safe_load(llama.read_text()), headers=tokens.headers()
    ).json()
    assert ok["ok"] and ok["tokens_per_step"] == 131_072 and ok["microbatches_per_step"] == 4
    assert client.get("/v1/runs", headers=tokens.headers()).json()["total"] == 0


def test_validate_renders_the_first_attempts_sbatch_on_request(
    client: TestClient, tokens: Tokens
) -> None:
    gpu = {**TINY_SPEC, "resources": {"nodes": 2, "gpus_per_node": 2, "memory_gib": 64}}
    plain = client.post("/v1/specs/validate", json=gpu, headers=tokens.headers("read")).json()
    assert plain["sbatch"] is None
    body = client.post(
        "/v1/specs/validate?render=sbatch", json=gpu, headers=tokens.headers("read")
    ).json()
    sbatch = body["sbatch"]
    assert sbatch["parameters"]["gpus_per_node"] == 2 and sbatch["parameters"]["mem"] == "64G"
    assert "#SBATCH --gpus-per-node=2" in sbatch["script"].splitlines()
    assert "NIGHTWATCH_WORKER_TOKEN" not in sbatch["environment"]
    cpu = client.post(
        "/v1/specs/validate?render=sbatch", json=TINY_SPEC, headers=tokens.headers("read")
    ).json()["sbatch"]
    assert "gpus_per_node" not in cpu["parameters"]
    assert cpu["environment"]["CUDA_VISIBLE_DEVICES"] == ""
    bad = client.post(
        "/v1/specs/validate?render=yaml", json=TINY_SPEC, headers=tokens.headers("read")
    )
    assert bad.status_code == 422
    assert client.get("/v1/runs", headers=tokens.headers()).json()["total"] == 0


def test_list_filters_by_state_and_name_and_pages(
    client: TestClient, tokens: Tokens, database: Database
) -> None:
    ids = [
        submit(client, tokens, {**TINY_SPEC, "name": f"job-{i % 2}"}).json()["id"] for i in range(5)
    ]
    with database.write_session() as s:
        store.transition_run(s, ids[0], RunState.SUBMITTED)
    h = tokens.headers("read")
    page1 = client.get("/v1/runs", params={"limit": 2}, headers=h).json()
    page2 = client.get("/v1/runs", params={"limit": 2, "offset": 2}, headers=h).json()
    page3 = client.get("/v1/runs", params={"limit": 2, "offset": 4}, headers=h).json()
    seen = [r["id"] for p in (page1, page2, page3) for r in p["items"]]
    assert sorted(seen) == sorted(ids) and len(set(seen)) == 5
    assert seen == ids[::-1]  # newest first
    assert (page1["next_offset"], page2["next_offset"], page3["next_offset"]) == (2, 4, None)
    submitted = client.get("/v1/runs", params={"state": "submitted"}, headers=h).json()
    assert [r["id"] for r in submitted["items"]] == [ids[0]]
    both = client.get("/v1/runs", params={"state": ["submitted", "pending"]}, headers=h).json()
    assert both["total"] == 5
    named = client.get("/v1/runs", params={"name": "job-1"}, headers=h).json()
    assert named["total"] == 2 and {r["name"] for r in named["items"]} == {"job-1"}
    bad = client.get("/v1/runs", params={"state": "sleeping", "limit": 0}, headers=h)
    assert bad.status_code == 422
    assert {p["field"] for p in bad.json()["problems"]} == {"query.state.0", "query.limit"}


def test_cancel_and_events_timeline(client: TestClient, tokens: Tokens, database: Database) -> None:
    h = tokens.headers()
    pending = submit(client, tokens).json()["id"]
    cancelled = client.post(f"/v1/runs/{pending}/cancel", headers=h).json()
    assert cancelled["state"] == "cancelled"

    running = submit(client, tokens).json()["id"]
    with database.write_session() as s:
        store.create_attempt(s, running, executor="slurm", job_id="77")
        store.transition_run(s, running, RunState.SUBMITTED)
        store.transition_run(s, running, RunState.RUNNING)
        store.open_incident(s, running, 1, "loss_spike", evidence={"loss": 9.1, "median": 2.0})
    requested = client.post(f"/v1/runs/{running}/cancel", headers=h).json()
    assert requested["state"] == "running" and requested["cancel_requested"] is True

    events = client.get(f"/v1/runs/{running}/events", headers=h).json()
    kinds = [e["kind"] for e in events["items"]]
    assert kinds == ["state_change", "info", "state_change", "state_change", "incident", "info"]
    incident = events["items"][4]
    assert incident["attempt"] == 1 and incident["data"]["loss"] == 9.1
    later = client.get(
        f"/v1/runs/{running}/events", params={"after": events["items"][3]["id"]}, headers=h
    ).json()
    assert [e["kind"] for e in later["items"]] == [EventKind.INCIDENT, EventKind.INFO]
    assert later["next_after"] == events["next_after"]

    detail = client.get(f"/v1/runs/{running}", headers=h).json()
    assert detail["attempts"][0]["job_id"] == "77"


def test_unknown_or_malformed_run_ids(client: TestClient, tokens: Tokens) -> None:
    h = tokens.headers()
    missing = client.get("/v1/runs/r-000000000000", headers=h)
    assert missing.status_code == 404 and "r-000000000000" in missing.json()["message"]
    assert client.post("/v1/runs/r-000000000000/cancel", headers=h).status_code == 404
    assert client.get("/v1/runs/r-000000000000/events", headers=h).status_code == 404
    assert client.get("/v1/runs/nope", headers=h).status_code == 422
    assert client.get("/v1/nothing-here").json()["error"] == "not_found"


def test_worker_registration_feeds_prometheus_service_discovery(
    client: TestClient, tokens: Tokens, database: Database
) -> None:
    run = submit(client, tokens).json()["id"]
    other = submit(client, tokens, {**TINY_SPEC, "name": "other"}).json()["id"]
    with database.write_session() as s:
        store.create_attempt(s, run, executor="local")
        store.transition_run(s, run, RunState.RUNNING, expected=None)
        store.transition_run(s, run, RunState.SUBMITTED)
        _, worker_secret = store.create_token(s, "worker", [Scope.SUBMIT], run_id=run)
    worker = {"Authorization": f"Bearer {worker_secret}"}
    url = f"/v1/runs/{run}/attempts/1/endpoints/n1"
    assert (
        client.put(url, json={"host": "127.0.0.1", "port": 9400}, headers=worker).status_code == 204
    )
    foreign = f"/v1/runs/{other}/attempts/1/endpoints/n1"
    assert (
        client.put(foreign, json={"host": "127.0.0.1", "port": 1}, headers=worker).status_code
        == 403
    )
    assert client.post("/v1/runs", json=TINY_SPEC, headers=worker).status_code == 403
    bad = client.put(url, json={"host": "127.0.0.1", "port": 70000}, headers=worker)
    assert bad.status_code == 422 and bad.json()["problems"][0]["field"] == "port"
    targets = client.get("/v1/prometheus/targets", headers=tokens.headers("read")).json()
    assert targets == [
        {"targets": ["127.0.0.1:9400"], "labels": {"run_id": run, "attempt": "1", "node": "n1"}}
    ]


def test_healthz_and_metrics(client: TestClient, tokens: Tokens) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok"}
    submit(client, tokens)
    submit(client, tokens)
    text = client.get("/metrics").text
    assert 'nightwatch_supervisor_runs{state="pending"} 2.0' in text
    assert 'nightwatch_supervisor_runs{state="running"} 0.0' in text
    assert (
        'nightwatch_supervisor_http_requests_total{method="POST",route="/v1/runs",status="201"} 2.0'
        in text
    )
    assert client.app.state.metrics.registry is client.app.state.registry


def test_openapi_has_examples_and_security(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    post = schema["paths"]["/v1/runs"]["post"]
    examples = post["requestBody"]["content"]["application/json"]["examples"]
    assert examples["tiny"]["value"]["name"] == "tiny-cpu"
    assert {"201", "200", "400", "401", "403", "409", "422"} <= set(post["responses"])
    assert "HTTPBearer" in schema["components"]["securitySchemes"]


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_revocation_applies_after_the_token_cache_ttl(database: Database, tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from supervisor.api.app import create_app
    from supervisor.settings import Settings

    with database.write_session() as s:
        token, secret = store.create_token(s, "ci", [Scope.READ])
    headers = {"Authorization": f"Bearer {secret}"}
    for ttl, after_revoke in ((60.0, 200), (0.0, 401)):
        app = create_app(
            Settings(home=tmp_path, token_cache_seconds=ttl),
            database=database,
            registry=CollectorRegistry(),
        )
        with TestClient(app) as c:
            assert c.get("/v1/runs", headers=headers).status_code == 200
            with database.write_session() as s:
                store.revoke_token(s, token.id)
            assert c.get("/v1/runs", headers=headers).status_code == after_revoke
        with database.write_session() as s:  # un-revoke for the next round
            s.get(type(token), token.id).revoked = False
            s.commit()
