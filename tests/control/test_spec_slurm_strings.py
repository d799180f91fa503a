"""Strings bound for sbatch: an injection corpus per field is refused with a 422 naming the
field (submit and validate), list limits hold, and a valid spec renders an sbatch script
whose every `#SBATCH` line is intact."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import submitit
from fastapi.testclient import TestClient

from contracts.slurm_names import MAX_EXCLUDED_NODES, expand_nodes
from contracts.spec import MAX_FAULTS, RunSpec
from supervisor.api.examples import TINY_SPEC
from supervisor.launcher import SubmitPlan, job_request
from supervisor.slurm import InvalidRequest, JobRequest, SlurmCluster, sbatch_parameters

Tokens = Any

HOSTILE = [
    'gpu"\n#SBATCH --wrap=id',
    "gpu\n#SBATCH --uid=0",
    "$(touch /tmp/pwned)",
    "`id`",
    "gpu;id",
    "gpu id",
    "gpu\x00x",
    "gpu#x",
    "gpu,other",
    "'gpu'",
    "g" * 65,
    "",
]
#: The same for node lists: what python-hostlist rejects, and names SLURM does not allow.
HOSTILE_NODES = [*HOSTILE[:8], "n[1-", "n[5-1]", "a]b", "n[1-3];id", "n" * 300]


def _with(section: str, field: str, value: object) -> dict[str, Any]:
    spec = copy.deepcopy(TINY_SPEC)
    spec.setdefault(section, {})[field] = value
    return spec


def _fields(response: Any) -> set[str]:
    return {p["field"].split(".")[0] + "." + p["field"].split(".")[1] for p in
            response.json()["problems"] if p["field"].count(".")}  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/specs/validate"])
@pytest.mark.parametrize("field", ["partition", "account", "qos"])
def test_hostile_slurm_names_are_422_naming_the_field(
    client: TestClient, tokens: Tokens, path: str, field: str
) -> None:
    for value in HOSTILE:
        response = client.post(path, json=_with("resources", field, value),
                               headers=tokens.headers())  # fmt: skip
        assert response.status_code == 422, (value, response.text)
        assert {p["field"] for p in response.json()["problems"]} == {f"resources.{field}"}


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/specs/validate"])
def test_hostile_exclude_entries_are_422_naming_the_field(
    client: TestClient, tokens: Tokens, path: str
) -> None:
    for value in HOSTILE_NODES:
        response = client.post(path, json=_with("resources", "exclude", ["n1", value]),
                               headers=tokens.headers())  # fmt: skip
        assert response.status_code == 422, (value, response.text)
        fields = {p["field"] for p in response.json()["problems"]}
        assert fields <= {"resources.exclude", "resources.exclude.1"} and fields, fields


def test_hostile_fault_node_is_422_naming_the_field(client: TestClient, tokens: Tokens) -> None:
    for value in HOSTILE:
        spec = {**TINY_SPEC, "faults": [{"kind": "node", "node": value, "effect": "hang"}]}
        response = client.post("/v1/runs", json=spec, headers=tokens.headers("admin"))
        assert response.status_code == 422, (value, response.text)
        assert {p["field"] for p in response.json()["problems"]} == {"faults.0.node.node"}


def test_exclude_accepts_hostlists_and_stores_them_expanded(
    client: TestClient, tokens: Tokens
) -> None:
    spec = _with("resources", "exclude", ["gpu[01-03,7]", "n2"])
    response = client.post("/v1/runs", json=spec, headers=tokens.headers())
    assert response.status_code == 201, response.text
    run = client.get(f"/v1/runs/{response.json()['id']}", headers=tokens.headers()).json()
    assert run["spec"]["resources"]["exclude"] == ["gpu01", "gpu02", "gpu03", "gpu7", "n2"]


def test_list_limits_are_422(client: TestClient, tokens: Tokens) -> None:
    many = [f"n{i}" for i in range(MAX_EXCLUDED_NODES + 1)]
    response = client.post("/v1/runs", json=_with("resources", "exclude", many),
                           headers=tokens.headers())  # fmt: skip
    assert response.status_code == 422
    assert {p["field"] for p in response.json()["problems"]} == {"resources.exclude"}
    wide = _with("resources", "exclude", ["n[0-2000]"])  # one entry, too many nodes
    response = client.post("/v1/runs", json=wide, headers=tokens.headers())
    assert response.status_code == 422
    assert "more than 1024 nodes" in response.json()["message"]
    crash = {"kind": "crash", "step": 1}
    faults = {**TINY_SPEC, "faults": [crash] * (MAX_FAULTS + 1)}
    response = client.post("/v1/runs", json=faults, headers=tokens.headers("admin"))
    assert response.status_code == 422
    assert {p["field"] for p in response.json()["problems"]} == {"faults"}
    long_path = _with("checkpoint", "dir", "/" + "a" * 5000)
    response = client.post("/v1/runs", json=long_path, headers=tokens.headers())
    assert response.status_code == 422
    assert {p["field"] for p in response.json()["problems"]} == {"checkpoint.dir"}


def test_expand_nodes() -> None:
    assert expand_nodes(["n[1-3,5]", "gpu07", "n2"]) == ["n1", "n2", "n3", "n5", "gpu07", "n2"]
    for bad in ("n[1-", "a b", "n1;id", ""):
        with pytest.raises(ValueError):
            expand_nodes([bad])


@pytest.mark.parametrize("field", ["partition", "account", "qos", "job_name"])
def test_sbatch_parameters_refuse_what_the_spec_would(field: str) -> None:
    """Anything stored before the spec checked it still never reaches sbatch."""
    fields = {"job_name": "nw-r-a1", field: 'x"\n#SBATCH --wrap=id'}
    request = JobRequest(log_dir=Path("/tmp/x"), nodes=1, tasks_per_node=1, **fields)
    with pytest.raises(InvalidRequest):
        sbatch_parameters(request)
    with pytest.raises(InvalidRequest):
        sbatch_parameters(JobRequest("nw-r-a1", Path("/tmp/x"), 1, 1, exclude=("n1;id",)))
    with pytest.raises(InvalidRequest):
        SlurmCluster().drain("n1 state=RESUME", "why")
    with pytest.raises(InvalidRequest):
        SlurmCluster().find_jobs("nw-r-a1 --user=root")


def test_valid_spec_renders_intact_sbatch_directives(tmp_path: Path) -> None:
    """The script submitit would hand to sbatch: one `#SBATCH --key=value` per parameter, each
    value exactly the spec's, and no line the spec's strings added."""
    spec = RunSpec.model_validate(
        {**TINY_SPEC, "resources": {**TINY_SPEC["resources"], "partition": "gpu-a100",
         "account": "team_llm.2", "qos": "high", "exclude": ["n[01-02]", "gpu7"]}}
    )  # fmt: skip
    plan = SubmitPlan(run_id="r-0123456789ab", attempt=3, spec=spec,
                      checkpoint_dir=tmp_path / "ck", log_dir=tmp_path / "logs")  # fmt: skip
    executor = submitit.SlurmExecutor(folder=tmp_path / "logs" / "%j")
    executor.update_parameters(**sbatch_parameters(job_request(plan)))
    script = executor._make_submission_file_text("python -m worker", "uid")
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert all(re.fullmatch(r"#SBATCH --[a-z-]+(=[^\s\"'`$;#]+)?", d) for d in directives), (
        directives
    )
    values = dict(d.removeprefix("#SBATCH --").partition("=")[::2] for d in directives)
    assert values["partition"] == "gpu-a100" and values["account"] == "team_llm.2"
    assert values["qos"] == "high" and values["exclude"] == "gpu7,n01,n02"
    assert values["job-name"] == "nw-r-0123456789ab-a3" and values["no-requeue"] == ""
    body = [line for line in script.splitlines() if line and not line.startswith("#")]
    assert not any("SBATCH" in line for line in body)
