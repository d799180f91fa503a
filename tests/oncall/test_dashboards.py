"""Structure of the provisioned Grafana dashboards (Grafana itself is not installable here;
the truth test proves the queries against Prometheus)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from promql_truth import all_queries, selectors, substitute, variables_used

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "dashboards" / "grafana"
CONTRACTS = REPO / "docs" / "contracts.md"
BUILTINS = {"__rate_interval", "__interval", "__range"}


def _dashboards() -> dict[str, dict[str, Any]]:
    return {
        p.name: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))
    }


def _panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def _datasource_uids() -> set[str]:
    provisioning = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    return {ds["uid"] for ds in provisioning["datasources"]}


def test_both_dashboards_are_provisioned_with_unique_uids() -> None:
    dashboards = _dashboards()
    assert set(dashboards) == {"run.json", "fleet.json"}
    uids = [d["uid"] for d in dashboards.values()]
    assert len(set(uids)) == len(uids)
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/nightwatch.yml").read_text())
    (p,) = provider["providers"]
    assert p["type"] == "file" and p["options"]["path"] == "/var/lib/grafana/dashboards"


@pytest.mark.parametrize("name", ["run.json", "fleet.json"])
def test_panels_are_well_formed(name: str) -> None:
    d = _dashboards()[name]
    uids = _datasource_uids()
    ids = [p["id"] for p in _panels(d)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in _panels(d):
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["title"] and p["targets"], p["title"]
        assert p["datasource"]["uid"] in uids, p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] in uids and t["expr"].strip(), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    for a in d["annotations"]["list"]:
        assert a["datasource"]["uid"] in uids


def test_panels_do_not_overlap() -> None:
    for name, d in _dashboards().items():
        cells: dict[tuple[int, int], str] = {}
        for p in _panels(d):
            g = p["gridPos"]
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{name}: {p['title']} overlaps {cells[(x, y)]}"
                    cells[(x, y)] = p["title"]


def test_every_query_uses_only_variables_that_exist() -> None:
    dashboards = _dashboards()
    for q in all_queries():
        if q.kind == "alert":
            assert not variables_used(q.expr), q.source
            continue
        d = dashboards[q.source.split(":")[0]]
        defined = {v["name"] for v in d["templating"]["list"]} | BUILTINS
        assert variables_used(q.expr) <= defined, f"{q.source}: {q.expr}"
        substitute(q.expr, {v: "x" for v in defined})  # every variable resolvable


def test_run_dashboard_is_scoped_to_its_run() -> None:
    """Every train-metric selector on the Run dashboard filters by run_id."""
    for q in all_queries():
        if not q.source.startswith("run.json") or q.kind == "variable":
            continue
        for s in selectors(q.expr):
            if s.startswith("nightwatch_train_") or s.startswith("nightwatch_supervisor_run_"):
                assert 'run_id="$run_id"' in s, f"{q.source}: {s}"


def test_run_dashboard_covers_what_on_call_asked_for() -> None:
    titles = " / ".join(p["title"] for p in _panels(_dashboards()["run.json"])).lower()
    for needed in ("loss", "grad norm", "tokens/s", "mfu", "step time per node", "progress",
                   "eta", "checkpoint age", "replica", "incidents", "ettr",
                   "validation loss"):  # fmt: skip
        assert needed in titles, needed
    for needed in ("since last step", "run state"):
        assert needed in titles, needed
    grad = next(p for p in _panels(_dashboards()["run.json"]) if p["title"] == "Grad norm")
    steps = grad["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[-1]["value"] == 10
    assert grad["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "line"


def test_fleet_and_run_link_to_each_other_and_runs_open_their_dashboard() -> None:
    boards = _dashboards()
    assert [link["url"] for link in boards["run.json"]["links"]] == [
        "/d/nightwatch-fleet/nightwatch-fleet"
    ]
    assert [link["url"] for link in boards["fleet.json"]["links"]] == [
        "/d/nightwatch-run/nightwatch-run"
    ]
    by_run = next(
        p
        for p in _panels(boards["fleet.json"])
        if p["title"] == "ETTR, budget and incidents by run"
    )
    (link,) = by_run["fieldConfig"]["defaults"]["links"]
    assert "var-run_id=${__data.fields.run_id}" in link["url"]


def _contract_names() -> set[str]:
    text = CONTRACTS.read_text()
    train = set(re.findall(r"^\| `(nightwatch_train_\w+)` \|", text, re.M))
    section = text.split("## Supervisor metrics", 1)[1].split("\n## ", 1)[0]
    supervisor = {
        f"nightwatch_supervisor_{n}" for n in re.findall(r"`(\w+)(?:\{[^}]*\})?`", section)
    }
    return train | supervisor


def test_every_metric_name_is_in_the_contract() -> None:
    names = _contract_names()
    assert "nightwatch_train_loss_summed_total" in names
    assert "nightwatch_supervisor_mttr_seconds" in names
    for q in all_queries():
        for s in selectors(q.expr):
            name = s.split("{")[0]
            if name == "up":
                continue
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert name in names or base in names, f"{q.source}: {name} is not in contracts.md"


def test_harness_extracts_every_query() -> None:
    """The truth test is only as good as its extraction: nothing may slip past it."""
    queries = all_queries()
    dashboards = _dashboards()
    targets = sum(len(p.get("targets", [])) for d in dashboards.values() for p in _panels(d))
    annotations = sum(len(d["annotations"]["list"]) for d in dashboards.values())
    variables = sum(len(d["templating"]["list"]) for d in dashboards.values())
    rules = yaml.safe_load((REPO / "dashboards/prometheus/alerts.yml").read_text())["groups"]
    kinds = [q.kind for q in queries]
    assert kinds.count("panel") == targets
    assert kinds.count("annotation") == annotations
    assert kinds.count("variable") == variables
    assert kinds.count("alert") == sum(len(g["rules"]) for g in rules)
