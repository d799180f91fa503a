"""The dashboard truth test against a real Prometheus fed by contract-named exporters.

This proves every panel and alert expression parses and that every metric name and label it
uses exists as the contract exports it. (Wired to a real training run and supervisor by the
end-to-end suite; here the exporters are driven by the test.)
"""

from __future__ import annotations

import math

import pytest
from oncall_live import RUN_ID, LivePrometheus
from promql_truth import Query, all_queries, failures, run_queries

pytestmark = pytest.mark.integration  # a real Prometheus server


def test_every_dashboard_and_alert_query_returns_data(live_prometheus: LivePrometheus) -> None:
    queries = all_queries()
    assert {q.kind for q in queries} == {"panel", "variable", "annotation", "alert"}
    results = run_queries(queries, live_prometheus.url, {"run_id": RUN_ID})
    assert not failures(results), "\n".join(failures(results))
    nan_panels = [r.query.source for r in results if r.query.kind == "panel" and not r.finite]
    assert not nan_panels, f"panels that show only NaN: {nan_panels}"


def test_workers_were_discovered_through_authenticated_http_sd(
    live_prometheus: LivePrometheus,
) -> None:
    assert live_prometheus.sd.served > 0
    assert live_prometheus.sd.unauthorized == 0
    up = live_prometheus.query('up{job="nightwatch-workers"}')
    assert sorted(s["metric"]["node"] for s in up) == ["n1", "n2"]
    # honor_labels keeps the worker's own labels: no exported_* duplicates
    step = live_prometheus.query(f'nightwatch_train_step{{run_id="{RUN_ID}"}}')
    assert step and not any(k.startswith("exported_") for k in step[0]["metric"])


def test_straggler_panel_singles_out_the_slow_node(live_prometheus: LivePrometheus) -> None:
    (query,) = [q for q in all_queries() if "Straggler ratio" in q.source]
    (result,) = run_queries([query], live_prometheus.url, {"run_id": RUN_ID})
    assert result.ok
    ratios = {s["metric"]["node"]: float(s["value"][1]) for s in live_prometheus.query(result.expr)}
    assert ratios["n2"] > ratios["n1"]
    assert math.isclose(ratios["n2"] / ratios["n1"], 0.9 / 0.5, rel_tol=1e-6)


@pytest.mark.parametrize(
    ("query", "why"),
    [
        (Query("typo", "panel", 'nightwatch_train_los{run_id="$run_id"}'), "no data"),
        (Query("label", "panel", 'nightwatch_train_loss{run="$run_id"}'), "no data"),
        (Query("parse", "panel", "sum(nightwatch_train_loss"), "bad_data"),
        (
            Query("cond", "alert", "nightwatch_train_lose > 1 and nightwatch_train_up == 1"),
            "no data for nightwatch_train_lose",
        ),
    ],
)
def test_harness_catches_broken_queries(
    live_prometheus: LivePrometheus, query: Query, why: str
) -> None:
    (result,) = run_queries([query], live_prometheus.url, {"run_id": RUN_ID})
    assert not result.ok
    assert why in failures([result])[0]


def test_a_quiet_alert_still_passes_when_its_selectors_have_data(
    live_prometheus: LivePrometheus,
) -> None:
    quiet = Query("quiet", "alert", "nightwatch_supervisor_run_recovery_budget_left <= 0")
    (result,) = run_queries([quiet], live_prometheus.url, {})
    assert result.series == 0 and result.ok
