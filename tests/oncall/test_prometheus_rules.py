"""The Prometheus config and alert rules, checked and unit-tested by the real promtool."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from promql_truth import all_queries, substitute

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "dashboards" / "prometheus"


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("`promtool` is required (Debian package prometheus)")
    return subprocess.run(
        [binary, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_check_config() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_check_rules() -> None:
    result = promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_can_fail(tmp_path: Path) -> None:
    """A wrong expectation makes promtool fail: the suite above is not vacuous."""
    shutil.copy(PROM / "alerts.yml", tmp_path / "alerts.yml")
    text = (PROM / "alerts_test.yml").read_text()
    (tmp_path / "alerts_test.yml").write_text(text.replace("24m 0s", "23m 0s"))
    result = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "NightwatchRunNotProgressing" in result.stdout + result.stderr


def test_every_alert_has_a_unit_test_and_a_severity() -> None:
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    fired = {
        case["alertname"]
        for t in tests
        for case in t.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert set(alerts) == fired
    assert {r["labels"]["severity"] for r in alerts.values()} <= {"page", "ticket"}
    assert all(r["annotations"].get("summary") for r in alerts.values())


def test_workers_are_discovered_from_the_supervisor_with_a_token() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["nightwatch-supervisor"]["static_configs"][0]["targets"] == ["supervisor:8787"]
    (sd,) = jobs["nightwatch-workers"]["http_sd_configs"]
    assert sd["url"].endswith("/v1/prometheus/targets")
    assert sd["authorization"] == {
        "type": "Bearer",
        "credentials_file": "/etc/prometheus/secrets/nightwatch_token",
    }
    assert jobs["nightwatch-workers"]["honor_labels"] is True
    assert config["rule_files"] == ["alerts.yml"]


#: Gauges a training process measures at each step; before its first step they hold 0.
PER_STEP = {
    "loss", "loss_window_max", "grad_norm", "grad_norm_window_max", "learning_rate",
    "step_time_seconds", "step_time_window_avg_seconds",
}  # fmt: skip
_TRAIN_METRIC = re.compile(r"\bnightwatch_train_(\w+)")


def _per_step_panels() -> list[str]:
    return [
        substitute(q.expr, {"run_id": "r-1"})
        for q in all_queries()
        if q.kind == "panel" and PER_STEP & set(_TRAIN_METRIC.findall(q.expr))
    ]


def test_a_process_before_its_first_step_shows_no_measurement(tmp_path: Path) -> None:
    """A restarted process exports its gauges from its start, at 0, until its first step
    (the last-step time says which): a panel drew a loss, learning rate or step time of 0
    at every restart. Evaluated by promtool on series of such a process alone."""
    panels = _per_step_panels()
    assert len(panels) >= 8
    names = sorted({n for expr in panels for n in _TRAIN_METRIC.findall(expr)})
    series = [
        {"series": f'nightwatch_train_{n}{{run_id="r-1",attempt="2",node="{node}"}}',
         "values": "0x10"}
        for n in names for node in ("n1", "n2")
    ]  # fmt: skip
    suite = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "promql_expr_test": [
                    {"expr": expr, "eval_time": "1m", "exp_samples": []} for expr in panels
                ],
            }
        ],
    }
    (tmp_path / "placeholders_test.yml").write_text(yaml.safe_dump(suite))
    result = promtool("test", "rules", "placeholders_test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_trainers_exposition_passes_promtool_check_metrics() -> None:
    """Names and types as Prometheus' own linter wants them (counters end in `_total`, no
    `_sum` outside summaries and histograms), for the run-level endpoint of global rank 0."""
    from prometheus_client import generate_latest

    from megatron_runs.metrics import TrainMetrics

    exposition = generate_latest(TrainMetrics("r-0", 1, "n1", run_level=True).registry)
    binary = shutil.which("promtool")
    assert binary is not None, "`promtool` is required (Debian package prometheus)"
    result = subprocess.run([binary, "check", "metrics"], input=exposition.decode(),
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stderr
