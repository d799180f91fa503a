"""Worker rank setup and supervisor registration (pure mapping; a real loopback HTTP server)."""

from __future__ import annotations

import socket

import pytest

from contracts.task import node_name
from worker.env import (
    MASTER_PORT_BASE,
    MASTER_PORT_SPAN,
    TaskInfo,
    dist_env,
    master_addr,
    master_port,
)
from worker.local_launch import FREE_PORTS, free_port
from worker.registration import Registrar

from .cluster_helpers import wait_until
from .endpoints import EndpointRegistry


def info(rank: int, local: int, hosts=("n1", "n2"), launch="127.0.0.1", job="1234") -> TaskInfo:
    return TaskInfo(
        job_id=job,
        hostnames=hosts,
        global_rank=rank,
        local_rank=local,
        num_tasks=4,
        num_nodes=2,
        launch_addr=launch,
    )


def test_dist_env_for_every_rank_of_two_by_two():
    envs = [dist_env(info(r, r % 2), resolves=lambda h: True) for r in range(4)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["MASTER_ADDR"] for e in envs} == {"n1"}  # first host of the allocation
    assert len({e["MASTER_PORT"] for e in envs}) == 1


def test_master_addr_falls_back_to_launch_address_for_unresolvable_names():
    assert master_addr(info(0, 0), resolves=lambda h: False) == "127.0.0.1"
    assert master_addr(info(0, 0, launch=None), resolves=lambda h: False) == "n1"


def test_master_port_is_per_job_and_stable():
    assert master_port("1234") == master_port("1234")
    assert master_port("1234") != master_port("1235")
    assert all(20000 <= master_port(str(j)) < 30000 for j in (0, 9999, 10000, 123456789))


def test_uneven_tasks_are_rejected():
    with pytest.raises(ValueError, match="do not divide"):
        dist_env(TaskInfo("1", ("a", "b"), 0, 0, num_tasks=3, num_nodes=2))


def test_node_name_prefers_slurmd_nodename(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    assert node_name() == "n3"
    monkeypatch.delenv("SLURMD_NODENAME")
    assert node_name()


def test_registrar_registers_and_heartbeats():
    with EndpointRegistry(worker_token="w", read_token="r") as sup:
        reg = Registrar(sup.url, "w", "run-a", 2, "n1", interval_s=0.05)
        reg.start("127.0.0.1", 9100)
        try:
            wait_until("three PUTs", lambda: sup.puts >= 3, timeout_s=5, interval_s=0.02)
        finally:
            reg.stop()
        assert sup.for_run("run-a", 2) == {"n1": {"host": "127.0.0.1", "port": 9100}}
        assert sup.puts >= 3  # the first PUT plus heartbeats


@pytest.mark.timeout(30)  # half the PUT's timeout: a start() that waited for it fails here
def test_registrar_start_does_not_wait_for_the_supervisor():
    """A supervisor that takes the connection and never answers: start() returns while the
    first PUT is still in flight (training goes on), and the PUT is made."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        reg = Registrar(url, "w", "r", 1, "n1", timeout_s=60.0)
        reg.start("127.0.0.1", 9100)
        try:
            conn, _ = silent.accept()  # the PUT reached the socket
            with conn:
                assert reg._thread is not None and reg._thread.is_alive()
        finally:
            reg.stop()


def test_registrar_never_raises_when_supervisor_is_down_or_refuses():
    with EndpointRegistry(worker_token="w", read_token="r") as sup:
        assert Registrar(sup.url, "wrong-token", "r", 1, "n1").beat() is False
        url = sup.url
    assert Registrar(url, "w", "r", 1, "n1", timeout_s=0.5).beat() is False


def test_every_node_of_an_ordered_attempt_finds_the_same_port(tmp_path, monkeypatch):
    """Only the newest order is kept: a node that missed one (a spare still importing when two
    came) must rendezvous where the nodes that saw both do."""
    from contracts.restart import RestartOrder
    from worker.task import TrainingTask

    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    hosts = ("n1", "n2", "n3")
    task = TrainingTask(
        "r-1", 1, "{}", str(tmp_path), run_dir=str(tmp_path), restart_wait_s=5.0,
        active_nodes=2,
    )  # fmt: skip

    def order(attempt: int, nodes: tuple[str, ...]) -> RestartOrder:
        return RestartOrder(attempt=attempt, log_dir=str(tmp_path / f"a{attempt}"), nodes=nodes)

    saw_both = task._ordered(order(2, ("n1", "n3")), "7")._ordered(order(3, ("n2", "n3")), "7")
    saw_last = task._ordered(order(3, ("n2", "n3")), "7")
    job = TaskInfo("7", hosts, 1, 0, num_tasks=3, num_nodes=3, launch_addr="127.0.0.1")
    ports = {
        dist_env(t._scheduled(job), resolves=lambda h: True)["MASTER_PORT"]  # type: ignore[arg-type]
        for t in (saw_both, saw_last)
    }
    first = dist_env(task._scheduled(job), resolves=lambda h: True)["MASTER_PORT"]  # type: ignore[arg-type]
    assert len(ports) == 1 and first not in ports


def test_free_ports_stay_clear_of_the_ports_jobs_bind_by_rule() -> None:
    rendezvous = range(MASTER_PORT_BASE, MASTER_PORT_BASE + MASTER_PORT_SPAN)
    assert FREE_PORTS.stop <= rendezvous.start  # and the soak baseline's, above them
    assert FREE_PORTS.stop <= 17900  # the dev clusters' fixed ports (the soak's default)
    assert all(free_port() in FREE_PORTS for _ in range(20))
