"""What a caller may submit beyond a valid spec: faults and node draining need `admin` (or the
server's leave), paths stay inside the operator's roots, and no two runs share a checkpoint
folder."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from contracts.spec import RunSpec
from supervisor import store
from supervisor.api.app import create_app
from supervisor.api.examples import TINY_SPEC
from supervisor.db import Database
from supervisor.settings import Settings

Tokens = Any

FAULTS = [{"kind": "crash", "step": 5}]


def _spec(**sections: dict[str, Any] | list[Any]) -> dict[str, Any]:
    spec = copy.deepcopy(TINY_SPEC)
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def _client(database: Database, settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings, database=database, registry=CollectorRegistry())
    with TestClient(app) as c:
        yield c


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    paths = {name: tmp_path / name for name in ("ckpt", "data", "elsewhere")}
    for path in paths.values():
        path.mkdir()
    return paths


@pytest.fixture
def rooted(database: Database, tmp_path: Path, roots: dict[str, Path]) -> Iterator[TestClient]:
    settings = Settings(
        home=tmp_path / "home", checkpoint_roots=(roots["ckpt"],), data_roots=(roots["data"],)
    )
    yield from _client(database, settings)


def _problems(response: Any) -> dict[str, str]:
    return {p["field"]: p["message"] for p in response.json()["problems"]}


# ---------------------------------------------------------------- privileged sections


@pytest.mark.parametrize(
    ("section", "field"),
    [({"faults": FAULTS}, "faults"),
     ({"recovery": {"drain_excluded_nodes": True}}, "recovery.drain_excluded_nodes")],
)  # fmt: skip
def test_faults_and_draining_need_admin(
    client: TestClient, tokens: Tokens, section: dict[str, Any], field: str
) -> None:
    spec = _spec(**section)
    refused = client.post("/v1/runs", json=spec, headers=tokens.headers("submit"))
    assert refused.status_code == 403, refused.text
    assert refused.json()["message"].startswith(f"{field} need the admin scope")
    assert client.get("/v1/runs", headers=tokens.headers()).json()["total"] == 0
    assert client.post("/v1/runs", json=spec, headers=tokens.headers("admin")).status_code == 201


@pytest.mark.parametrize(
    ("setting", "section"),
    [("allow_fault_injection", {"faults": FAULTS}),
     ("allow_node_drain", {"recovery": {"drain_excluded_nodes": True}})],
)  # fmt: skip
def test_a_server_setting_lets_submit_tokens_send_them(
    database: Database, tokens: Tokens, tmp_path: Path, setting: str, section: dict[str, Any]
) -> None:
    for client in _client(database, Settings(home=tmp_path / "home", **{setting: True})):
        response = client.post("/v1/runs", json=_spec(**section), headers=tokens.headers())
        assert response.status_code == 201, response.text


def test_settings_read_roots_and_privileges_from_the_environment(tmp_path: Path) -> None:
    env = {
        "NIGHTWATCH_HOME": str(tmp_path),
        "NIGHTWATCH_CHECKPOINT_ROOTS": os.pathsep.join(["/scratch/ckpt", "/lustre/ckpt"]),
        "NIGHTWATCH_DATA_ROOTS": "/datasets",
        "NIGHTWATCH_ALLOW_FAULT_INJECTION": "true",
    }
    settings = Settings.from_env(env)
    assert settings.checkpoint_root_dirs == (Path("/scratch/ckpt"), Path("/lustre/ckpt"))
    assert settings.data_root_dirs == (Path("/datasets"),)
    assert settings.allow_fault_injection and not settings.allow_node_drain
    defaults = Settings.from_env({"NIGHTWATCH_HOME": str(tmp_path)})
    assert defaults.checkpoint_root_dirs == defaults.data_root_dirs == (tmp_path,)
    assert not defaults.allow_fault_injection
    with pytest.raises(ValueError, match="absolute"):
        Settings.from_env({"NIGHTWATCH_DATA_ROOTS": "relative/data"})


# ---------------------------------------------------------------- paths


@pytest.mark.parametrize("field", ["checkpoint.dir", "data.prefix", "data.tokenizer"])
def test_path_shapes_are_refused_naming_the_field(
    client: TestClient, tokens: Tokens, field: str
) -> None:
    section, name = field.split(".")
    for value in ["/x/../../etc", "relative/dir", "/x/\x00y", "/x/\ny", "/x/\x1b[0m", ""]:
        for path in ("/v1/runs", "/v1/specs/validate"):
            response = client.post(path, json=_spec(**{section: {name: value}}),
                                   headers=tokens.headers())  # fmt: skip
            assert response.status_code == 422, (value, response.text)
            assert list(_problems(response)) == [field], response.text


@pytest.mark.parametrize("field", ["checkpoint.dir", "data.prefix", "data.tokenizer"])
def test_paths_outside_their_roots_are_422(
    rooted: TestClient, tokens: Tokens, roots: dict[str, Path], field: str
) -> None:
    section, name = field.split(".")
    other = "data" if section == "checkpoint" else "ckpt"
    link = roots["ckpt" if section == "checkpoint" else "data"] / "link"
    link.symlink_to(roots["elsewhere"])  # a symlink inside the root that leads out of it
    for value in ["/etc/passwd", str(roots[other] / "x"), str(link / "x"), "/"]:
        spec = _spec(**{section: {name: value}})
        response = rooted.post("/v1/runs", json=spec, headers=tokens.headers())
        assert response.status_code == 422, (value, response.text)
        assert list(_problems(response)) == [field]
        assert "is not inside an allowed root" in _problems(response)[field]
        report = rooted.post("/v1/specs/validate", json=spec, headers=tokens.headers()).json()
        assert report["ok"] is False and [p["field"] for p in report["problems"]] == [field]


def test_paths_inside_their_roots_are_stored_resolved(
    rooted: TestClient, tokens: Tokens, roots: dict[str, Path]
) -> None:
    (roots["ckpt"] / "real").mkdir()
    (roots["ckpt"] / "alias").symlink_to(roots["ckpt"] / "real")
    spec = _spec(
        checkpoint={"dir": f"{roots['ckpt']}/alias/./run1/"},
        data={"prefix": f"{roots['data']}//corpus/text_document",
              "tokenizer": f"{roots['data']}/corpus/tokenizer.json"},
    )  # fmt: skip
    assert rooted.post("/v1/specs/validate", json=spec, headers=tokens.headers()).json()["ok"]
    response = rooted.post("/v1/runs", json=spec, headers=tokens.headers())
    assert response.status_code == 201, response.text
    stored = rooted.get(f"/v1/runs/{response.json()['id']}", headers=tokens.headers()).json()
    assert stored["spec"]["checkpoint"]["dir"] == str(roots["ckpt"].resolve() / "real" / "run1")
    assert stored["spec"]["data"]["prefix"] == str(roots["data"].resolve() / "corpus/text_document")


def test_every_blend_prefix_stays_inside_the_data_roots(
    rooted: TestClient, tokens: Tokens, roots: dict[str, Path]
) -> None:
    inside = f"{roots['data']}/./a/text_document"
    blend = [{"prefix": inside, "weight": 1}, {"prefix": "/etc/passwd", "weight": 2}]
    response = rooted.post("/v1/runs", json=_spec(data={"blend": blend}), headers=tokens.headers())
    assert response.status_code == 422, response.text
    assert list(_problems(response)) == ["data.blend[1].prefix"]
    blend[1]["prefix"] = f"{roots['data']}/b/text_document"
    response = rooted.post("/v1/runs", json=_spec(data={"blend": blend}), headers=tokens.headers())
    assert response.status_code == 201, response.text
    stored = rooted.get(f"/v1/runs/{response.json()['id']}", headers=tokens.headers()).json()
    assert [p["prefix"] for p in stored["spec"]["data"]["blend"]] == [
        str(roots["data"].resolve() / "a/text_document"),
        str(roots["data"].resolve() / "b/text_document"),
    ]


def test_default_roots_are_home_but_not_its_runs_folder(
    client: TestClient, tokens: Tokens, app_settings: Settings
) -> None:
    home = app_settings.home
    home.mkdir(parents=True, exist_ok=True)
    ok = client.post("/v1/runs", json=_spec(checkpoint={"dir": str(home / "ck" / "a")}),
                     headers=tokens.headers())  # fmt: skip
    assert ok.status_code == 201, ok.text
    for value in [str(home / "runs" / "r-0123456789ab" / "checkpoints"), str(home / "runs"),
                  str(home), str(home.parent / "next-door")]:  # fmt: skip
        response = client.post("/v1/runs", json=_spec(checkpoint={"dir": value}),
                               headers=tokens.headers())  # fmt: skip
        assert response.status_code == 422, (value, response.text)
        assert list(_problems(response)) == ["checkpoint.dir"]


def test_two_runs_never_share_a_checkpoint_folder(
    rooted: TestClient, tokens: Tokens, roots: dict[str, Path], database: Database
) -> None:
    base = roots["ckpt"] / "team"
    first = rooted.post("/v1/runs", json=_spec(checkpoint={"dir": str(base / "a")}),
                        headers=tokens.headers())  # fmt: skip
    assert first.status_code == 201
    (roots["ckpt"] / "to-a").symlink_to(base / "a")
    for value in [base / "a", base / "a" / "inner", base, roots["ckpt"] / "to-a"]:
        response = rooted.post("/v1/runs", json=_spec(checkpoint={"dir": str(value)}),
                               headers=tokens.headers("admin"))  # fmt: skip
        assert response.status_code == 409, (value, response.text)
        assert response.json()["message"] == "checkpoint.dir is in use by another run"
    # a finished run's folder stays its own: its checkpoints are what it produced
    with database.write_session() as s:
        store.update_run(s, first.json()["id"], state="cancelled")
    again = rooted.post("/v1/runs", json=_spec(checkpoint={"dir": str(base / "a")}),
                        headers=tokens.headers())  # fmt: skip
    assert again.status_code == 409
    neighbour = rooted.post("/v1/runs", json=_spec(checkpoint={"dir": str(base / "a2")}),
                            headers=tokens.headers())  # fmt: skip
    assert neighbour.status_code == 201, neighbour.text


def test_a_retry_keeps_its_own_folder(rooted: TestClient, tokens: Tokens, roots: dict[str, Path]):
    spec = _spec(checkpoint={"dir": str(roots["ckpt"] / "r")})
    headers = {**tokens.headers(), "Idempotency-Key": "k-1"}
    first = rooted.post("/v1/runs", json=spec, headers=headers)
    retry = rooted.post("/v1/runs", json=spec, headers=headers)
    assert (first.status_code, retry.status_code) == (201, 200)
    assert retry.json()["id"] == first.json()["id"]


def test_one_batch_never_hands_one_folder_to_two_runs(database: Database, tmp_path: Path) -> None:
    """The submission writer stores concurrent requests in one transaction."""
    spec = RunSpec.model_validate(_spec(checkpoint={"dir": str(tmp_path / "shared")}))
    nested = RunSpec.model_validate(_spec(checkpoint={"dir": str(tmp_path / "shared" / "x")}))
    requests = [store.NewRun(spec), store.NewRun(nested), store.NewRun(spec, None, "k")]
    with database.write_session() as s:
        outcomes = store.add_runs(s, requests)
        s.commit()
    assert isinstance(outcomes[0], tuple) and outcomes[0][1] is True
    assert all(isinstance(o, store.CheckpointDirInUse) for o in outcomes[1:])
    with database.write_session() as s, pytest.raises(store.CheckpointDirInUse):
        store.create_run(s, nested)
