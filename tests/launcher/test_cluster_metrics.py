"""Prometheus finds the workers through HTTP-SD and sees their step advance; batched polling."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from supervisor import launcher
from supervisor.slurm import JobState, wait_for
from worker.local_launch import free_port

from .cluster_helpers import wait_until
from .conftest import REPO, devcluster
from .endpoints import EndpointRegistry

pytestmark = pytest.mark.integration


def query_steps(prom_url: str, run_id: str) -> dict[str, float]:
    response = httpx.get(
        f"{prom_url}/api/v1/query",
        params={"query": f'nightwatch_train_step{{run_id="{run_id}"}}'},
        timeout=2,
    )
    response.raise_for_status()
    return {r["metric"]["node"]: float(r["value"][1]) for r in response.json()["data"]["result"]}


def test_prometheus_scrapes_workers_through_http_sd(slurm, tmp_path, toy_spec, toy_plan):
    prom_dir = tmp_path / "prometheus"
    port = free_port()
    with EndpointRegistry(worker_token="w-token", read_token="r-token") as sup:
        started = devcluster(
            "prometheus",
            "--port",
            str(port),
            "--sd-url",
            f"{sup.url}/v1/prometheus/targets",
            "--sd-token",
            "r-token",
            cluster_dir=prom_dir,
        )
        assert started.returncode == 0, started.stderr
        prom_url = f"http://127.0.0.1:{port}"
        try:
            plan = toy_plan(
                tmp_path,
                toy_spec("prom", steps=200, interval=1000),
                supervisor_url=sup.url,
                worker_token="w-token",
            )
            sub = launcher.submit(slurm, plan)
            wait_until("both nodes registered", lambda: len(sup.for_run("prom", 1)) == 2, 60)
            seen: list[float] = []

            def advanced() -> bool:
                steps = query_steps(prom_url, "prom")
                if len(steps) == 2:
                    seen.append(min(steps.values()))
                return len(seen) >= 2 and seen[-1] > seen[0] > 0

            t0 = time.monotonic()
            wait_until("Prometheus to see the step advance on both nodes", advanced, 30, 0.5)
            discovery_s = time.monotonic() - t0
            assert set(query_steps(prom_url, "prom")) == set(sup.for_run("prom", 1))
            assert discovery_s < 30
            slurm.cancel(sub.job_id)
            wait_for(slurm, sub.job_id, lambda s: s.state.terminal, timeout_s=30)
        finally:
            devcluster("stop", cluster_dir=prom_dir)


def test_poll_of_50_active_jobs_costs_one_slurm_call(slurm_conf):
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "poll_scale.py"),
            "--jobs",
            "50",
            "--ticks",
            "5",
            "--json",
        ],
        env={"SLURM_CONF": str(slurm_conf), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["calls_per_tick"] == 1
    states = result["states"]
    assert sum(states.values()) == 50
    assert set(states) <= {str(JobState.PENDING), str(JobState.RUNNING)}, states
