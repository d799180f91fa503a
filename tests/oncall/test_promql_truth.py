"""The truth harness's PromQL text handling (pure)."""

from __future__ import annotations

import pytest
from promql_truth import Query, dashboard_queries, selectors, substitute, variables_used


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ('sum by (kind) (increase(a_total{x="1"}[$__rate_interval]))', ['a_total{x="1"}']),
        (
            "x / on (run_id, attempt) group_left () quantile by (run_id) (0.5, x)",
            ["x"],
        ),
        ("histogram_quantile(0.95, sum by (le) (rate(h_bucket[5m])))", ["h_bucket"]),
        ('absent(up{job="s"}) or time() - max(t) > 60', ['up{job="s"}', "t"]),
        ('label_replace(m, "dst", "$1", "src", "(.*)") offset 5m', ["m"]),
        ("a > bool 1 unless on (n) b", ["a", "b"]),
        ("1e3 * c", ["c"]),
    ],
)
def test_selectors(expr: str, expected: list[str]) -> None:
    assert selectors(expr) == expected


def test_substitute_all_variable_syntaxes() -> None:
    expr = 'm{a="$run_id", b="${run_id}", c="[[node]]"}[$__rate_interval]'
    assert variables_used(expr) == {"run_id", "node", "__rate_interval"}
    out = substitute(expr, {"run_id": "r1", "node": "n1"})
    assert out == 'm{a="r1", b="r1", c="n1"}[1m]'
    with pytest.raises(KeyError, match="node"):
        substitute(expr, {"run_id": "r1"})


def test_dashboard_queries_cover_rows_variables_and_annotations() -> None:
    dashboard = {
        "panels": [
            {"type": "row", "title": "r", "panels": [
                {"title": "inner", "targets": [{"refId": "A", "expr": "a"}]},
            ]},
            {"title": "top", "targets": [{"refId": "A", "expr": "b"}, {"refId": "B"}]},
        ],
        "templating": {"list": [
            {"name": "run_id", "type": "query", "query": {"query": "label_values(m, run_id)"}},
            {"name": "fixed", "type": "custom", "query": "x,y"},
        ]},
        "annotations": {"list": [{"name": "ann", "expr": "c > 0"}]},
    }  # fmt: skip
    assert dashboard_queries(dashboard, "d.json") == [
        Query("d.json: panel 'inner' A", "panel", "a"),
        Query("d.json: panel 'top' A", "panel", "b"),
        Query("d.json: variable $run_id", "variable", "count by (run_id) (m)"),
        Query("d.json: annotation 'ann'", "annotation", "c > 0"),
    ]
