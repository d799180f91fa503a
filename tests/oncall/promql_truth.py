"""Dashboard truth harness: run every PromQL expression of the dashboards and alert rules.

A dashboard can be valid JSON and still show nothing (a typo in a metric name, a label that
does not exist, a variable that never matches). This harness extracts every query — panel
targets, template-variable queries, annotation queries, alert rules — substitutes Grafana's
variables, runs each against a real Prometheus and says which came back empty.

Panel queries must return data. Alert and annotation expressions are conditions (empty while
all is well), so for them every vector selector inside must return data instead: that still
proves each metric name and label matcher exists.

Usable on its own against any Prometheus:
`python tests/oncall/promql_truth.py --prometheus http://127.0.0.1:9090 --var run_id=r-…`
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards" / "grafana" / "dashboards"
ALERTS = REPO / "dashboards" / "prometheus" / "alerts.yml"

Kind = Literal["panel", "variable", "annotation", "alert"]
#: Grafana's built-in interval variables, resolved to fixed windows for an instant query.
DEFAULT_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}


@dataclass(frozen=True)
class Query:
    source: str  # where the expression lives, for the failure message
    kind: Kind
    expr: str


@dataclass(frozen=True)
class Result:
    query: Query
    expr: str  # after substitution
    error: str | None
    series: int
    finite: int  # series whose value is a finite number
    empty_selectors: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Parsed, and returned data (conditions: every selector in them returned data)."""
        if self.error is not None:
            return False
        if self.query.kind in ("alert", "annotation"):
            return not self.empty_selectors
        return self.series > 0


# --- extraction -----------------------------------------------------------------------------


def _panels(panels: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest their panels


def _variable_expr(variable: Mapping[str, Any]) -> str | None:
    """A query variable's PromQL; `label_values(m, l)` becomes `count by (l) (m)`."""
    query = variable.get("query")
    text = query.get("query") if isinstance(query, Mapping) else query
    if not text:
        return None
    match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", text, re.S)
    if match:
        return f"count by ({match[2]}) ({match[1]})"
    match = re.fullmatch(r"\s*query_result\((.*)\)\s*", text, re.S)
    return match[1] if match else text


def dashboard_queries(dashboard: Mapping[str, Any], name: str) -> list[Query]:
    out = []
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                source = f"{name}: panel {panel.get('title')!r} {target.get('refId', '')}"
                out.append(Query(source, "panel", target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query" and (expr := _variable_expr(variable)):
            out.append(Query(f"{name}: variable ${variable['name']}", "variable", expr))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if annotation.get("expr"):
            source = f"{name}: annotation {annotation['name']!r}"
            out.append(Query(source, "annotation", annotation["expr"]))
    return out


def alert_queries(rules: Mapping[str, Any], name: str) -> list[Query]:
    return [
        Query(f"{name}: {rule.get('alert') or rule.get('record')}", "alert", str(rule["expr"]))
        for group in rules.get("groups", [])
        for rule in group.get("rules", [])
    ]


def all_queries(dashboards_dir: Path = DASHBOARDS, alerts_file: Path = ALERTS) -> list[Query]:
    """Every query of every provisioned dashboard and alert rule in the repository."""
    out: list[Query] = []
    for path in sorted(dashboards_dir.glob("*.json")):
        out += dashboard_queries(json.loads(path.read_text()), path.name)
    out += alert_queries(yaml.safe_load(alerts_file.read_text()), alerts_file.name)
    return out


# --- PromQL text ----------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def variables_used(expr: str) -> set[str]:
    return {a or b or c for a, b, c in _VARIABLE.findall(expr)}


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace Grafana variables (`$x`, `${x}`, `[[x]]`); built-ins default to fixed windows."""
    merged = {**DEFAULT_BUILTINS, **values}

    def replace(match: re.Match[str]) -> str:
        name = match[1] or match[2] or match[3]
        if name not in merged:
            raise KeyError(f"no value for template variable ${name} in {expr!r}")
        return merged[name]

    return _VARIABLE.sub(replace, expr)


_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(
    r'"(?:[^"\\]|\\.)*"'  # a string outside braces: skipped
    r"|\{[^}]*\}"  # a bare matcher block: skipped
    r"|(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()"  # a name, not a function call
    r"(\s*\{[^}]*\})?"
)
_KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "atan2",
    # aggregation operators may put `by (…)` between their name and their parenthesis
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip


def selectors(expr: str) -> list[str]:
    """The vector selectors (metric name with its matchers) in a PromQL expression."""
    text = re.sub(r"\[[^\]]*\]", "", _GROUPING.sub(r"\1", expr))  # drop label lists, ranges
    found = []
    for match in _TOKEN.finditer(text):
        name, matchers = match[1], match[2]
        if name and name.lower() not in _KEYWORDS:
            selector = name + (matchers or "").strip()
            if selector not in found:
                found.append(selector)
    return found


# --- running --------------------------------------------------------------------------------


def _instant(client: httpx.Client, expr: str) -> tuple[str | None, list[Any]]:
    response = client.get("/api/v1/query", params={"query": expr})
    body = response.json()
    if body.get("status") != "success":
        return f"{body.get('errorType')}: {body.get('error')}", []
    data = body["data"]
    if data["resultType"] in ("scalar", "string"):
        return None, [{"value": data["result"]}]
    return None, data["result"]


def _finite(series: Sequence[Any]) -> int:
    count = 0
    for s in series:
        value = s.get("value", [0, "NaN"])[1]
        try:
            count += math.isfinite(float(value))
        except ValueError:
            continue
    return count


def run_queries(
    queries: Iterable[Query], prometheus_url: str, values: Mapping[str, str]
) -> list[Result]:
    """Execute each query (instant, at now) and report what came back."""
    results = []
    with httpx.Client(base_url=prometheus_url, timeout=10.0) as client:
        for query in queries:
            expr = substitute(query.expr, values)
            error, series = _instant(client, expr)
            empty: list[str] = []
            if error is None and query.kind in ("alert", "annotation"):
                empty = [s for s in selectors(expr) if not _instant(client, s)[1]]
            results.append(Result(query, expr, error, len(series), _finite(series), tuple(empty)))
    return results


def failures(results: Iterable[Result]) -> list[str]:
    """One line per failing query, naming where it lives and why."""
    lines = []
    for r in results:
        if r.ok:
            continue
        why = r.error or (
            f"no data for {', '.join(r.empty_selectors)}" if r.empty_selectors else "no data"
        )
        lines.append(f"{r.query.source}: {why}\n    {r.expr}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--var", action="append", default=[], help="NAME=VALUE (e.g. run_id=…)")
    args = parser.parse_args(argv)
    values = dict(v.split("=", 1) for v in args.var)
    results = run_queries(all_queries(), args.prometheus, values)
    bad = failures(results)
    print("\n".join(bad) if bad else f"all {len(results)} queries returned data")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
