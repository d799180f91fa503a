"""docker-compose.yml validated offline by Debian's docker-compose (no Docker engine here)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
REQUIRED = {"NIGHTWATCH_DB_PASSWORD": "pw", "GRAFANA_ADMIN_PASSWORD": "pw"}
SLURM = {
    "NIGHTWATCH_UID": "1000",
    "NIGHTWATCH_GID": "1000",
    "NIGHTWATCH_SHARED_HOME": "/shared/nightwatch",
    "NIGHTWATCH_LOGIN_HOST": "login1",
    "NIGHTWATCH_API_BIND": "0.0.0.0",
}


def compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("`docker-compose` is required (Debian package docker-compose)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("NIGHTWATCH_", "GRAFANA_"))}
    return subprocess.run(
        [binary, "--project-directory", str(REPO), *args],
        cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def resolved(*files: str, env: dict[str, str]) -> dict[str, Any]:
    flags = [a for f in files for a in ("-f", str(REPO / f))]
    result = compose(*flags, "config", env=env)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_compose_file_is_valid() -> None:
    result = compose("-f", "docker-compose.yml", "config", "-q", env=REQUIRED)
    assert result.returncode == 0, result.stderr


def test_secrets_are_required_not_defaulted() -> None:
    result = compose("-f", "docker-compose.yml", "config", "-q", env={})
    assert result.returncode != 0
    assert "NIGHTWATCH_DB_PASSWORD" in result.stderr


def test_services_and_wiring() -> None:
    config = resolved("docker-compose.yml", env=REQUIRED)
    services = config["services"]
    assert {"postgres", "supervisor", "prometheus", "grafana", "prometheus-token"} <= set(services)
    env = services["supervisor"]["environment"]
    assert env["NIGHTWATCH_DATABASE_URL"].startswith("postgresql+psycopg://nightwatch:pw@postgres:")
    assert env["NIGHTWATCH_PROMETHEUS_URL"] == "http://prometheus:9090"
    assert services["supervisor"]["build"]["context"] == str(REPO)
    assert (REPO / "Dockerfile").is_file()
    token_cmd = " ".join(services["prometheus-token"]["command"])
    assert "token create --name prometheus --scope read" in token_cmd
    prom_mounts = {v["target"]: v for v in _volumes(services["prometheus"])}
    assert prom_mounts["/etc/prometheus/secrets"]["source"] == "prometheus-secrets"
    # Alertmanager: its file rendered by the one-shot, and Prometheus sends to it
    assert "nightwatch alertmanager-config --out /config/alertmanager.yml" in " ".join(
        services["alertmanager-config"]["command"]
    )
    am_mounts = {v["target"]: v["source"] for v in _volumes(services["alertmanager"])}
    assert am_mounts["/etc/alertmanager"] == "alertmanager-config"
    assert "alertmanager" in services["prometheus"]["depends_on"]
    prom = yaml.safe_load((REPO / "dashboards" / "prometheus" / "prometheus.yml").read_text())
    targets = prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert targets == ["alertmanager:9093"]
    # published ports stay on loopback unless the operator says otherwise
    for name in ("supervisor", "prometheus", "grafana", "alertmanager"):
        assert [_host_ip(p) for p in services[name]["ports"]] == ["127.0.0.1"], name


def _host_ip(port: str | dict[str, Any]) -> str:
    """docker-compose 1.29 prints ports as `IP:HOST:CONTAINER/proto`."""
    return port["host_ip"] if isinstance(port, dict) else port.split(":")[0]


def _volumes(service: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
            kind = "bind" if source.startswith(("/", ".")) else "volume"
            v = {"type": kind, "source": source, "target": target}
        out.append(v)
    return out


def test_every_mounted_repository_path_exists() -> None:
    config = resolved("docker-compose.yml", env=REQUIRED)
    binds = [v for s in config["services"].values() for v in _volumes(s) if v["type"] == "bind"]
    assert len(binds) >= 5
    for v in binds:
        source = Path(v["source"])
        assert source.is_relative_to(REPO), f"{source} lies outside the repository"
        assert source.exists(), f"mounted path {source} does not exist"
    targets = {v["target"]: Path(v["source"]) for v in binds}
    prom_dir = targets["/etc/prometheus/prometheus.yml"].parent
    assert (prom_dir / "alerts.yml") == targets["/etc/prometheus/alerts.yml"]
    assert any(targets["/var/lib/grafana/dashboards"].glob("*.json"))


def test_slurm_overlay_mounts_the_login_node() -> None:
    config = resolved("docker-compose.yml", "docker-compose.slurm.yml", env=REQUIRED | SLURM)
    supervisor = config["services"]["supervisor"]
    mounts = {v["target"]: v["source"] for v in _volumes(supervisor)}
    assert mounts["/etc/slurm"] == "/etc/slurm" and mounts["/run/munge"] == "/run/munge"
    assert mounts["/shared/nightwatch"] == "/shared/nightwatch"
    assert supervisor["environment"]["NIGHTWATCH_EXECUTOR"] == "slurm"
    assert supervisor["environment"]["NIGHTWATCH_PUBLIC_URL"] == "http://login1:8787"
    assert supervisor["user"] == "1000:1000"
    assert [_host_ip(p) for p in supervisor["ports"]] == ["0.0.0.0"]
