"""The Prometheus config and alert rules, checked and unit-tested by the real promtool."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

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
