"""One task per node forking its ranks (`worker.ranks`): the rank mapping and outcome are pure;
the fork, the signal forwarding and the failed-peer kill run real child processes (no torch:
what a child does is a plain function here; the launcher tests train through it)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from worker.env import TaskInfo, dist_env, rank_infos
from worker.ranks import fork_ranks, node_outcome, rank_process_name


def node_task(node: int, nodes: int = 2) -> TaskInfo:
    """What submitit says to the task of `node` when each node runs one task."""
    return TaskInfo(
        job_id="77", hostnames=("n1", "n2"), global_rank=node, local_rank=0,
        num_tasks=nodes, num_nodes=nodes, launch_addr="127.0.0.1",
    )  # fmt: skip


def test_a_node_task_forks_the_ranks_one_task_per_rank_would_have_been():
    forked = [info for node in (0, 1) for info in rank_infos(node_task(node), 2)]
    per_rank = [
        TaskInfo("77", ("n1", "n2"), r, r % 2, 4, 2, launch_addr="127.0.0.1") for r in range(4)
    ]
    assert forked == per_rank
    envs = [dist_env(i, resolves=lambda h: True) for i in forked]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "4"), ("1", "1", "4"), ("2", "0", "4"), ("3", "1", "4"),
    ]  # fmt: skip
    assert rank_infos(node_task(1), 1) == [node_task(1)]
    with pytest.raises(ValueError):
        rank_infos(node_task(0), 0)


def test_the_first_failure_decides_and_a_requeue_beats_success():
    assert node_outcome([0, 0]) == 0
    assert node_outcome([75, 0]) == 75
    assert node_outcome([0, -9, 1]) == -9  # killed first; its peers' errors followed
    assert node_outcome([3, -9]) == 3  # the peer killed after the grace is a consequence
    assert node_outcome([]) == 0


def _run_forked(tmp_path: Path, body, ranks: int = 2, grace_s: float = 2.0) -> int:
    def run_rank(info: TaskInfo) -> int:
        (tmp_path / f"rank{info.global_rank}").write_text(
            f"{os.getpid()} {Path('/proc/self/comm').read_text().strip()}"
        )
        return body(info)

    return fork_ranks(rank_infos(node_task(0, nodes=1), ranks), run_rank, os._exit, grace_s)


def test_every_rank_runs_in_its_own_named_process(tmp_path):
    assert _run_forked(tmp_path, lambda info: 0, ranks=3) == 0
    seen = [(tmp_path / f"rank{r}").read_text().split() for r in range(3)]
    assert len({pid for pid, _ in seen} | {str(os.getpid())}) == 4
    assert [name for _, name in seen] == [rank_process_name(r) for r in range(3)]


def test_a_failed_rank_ends_the_node_and_a_stuck_peer_is_killed_after_the_grace(tmp_path):
    def body(info: TaskInfo) -> int:
        if info.global_rank == 1:
            return 3
        time.sleep(60)  # a peer that never notices
        return 0

    started = time.monotonic()
    assert _run_forked(tmp_path, body, grace_s=0.5) == 3
    assert time.monotonic() - started < 10


def test_a_rank_killed_by_a_signal_is_reported_as_that_signal(tmp_path):
    def body(info: TaskInfo) -> int:
        if info.global_rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        return 0

    assert _run_forked(tmp_path, body, grace_s=0.2) == -signal.SIGKILL


def test_a_stop_signal_to_the_node_reaches_every_rank(tmp_path):
    """The scheduler's USR2 (walltime) or TERM (preemption) may reach only the task: each rank
    must still checkpoint and leave with 75. Rank 0 signals the parent at once, while it may
    still be forking rank 1; both ranks wait for the forwarded signal. The parent has a second
    thread, as a test runner does (the CI's had): blocking a signal in the forking thread
    does not keep it from that one, and the first version lost it there."""
    stopped: list[int] = []
    idle = threading.Event()
    helper = threading.Thread(target=idle.wait, name="another-thread")
    helper.start()

    def record(signum: int, frame: object) -> None:
        stopped.append(signum)

    previous = signal.signal(signal.SIGUSR2, record)

    def body(info: TaskInfo) -> int:
        if info.global_rank == 0:
            os.kill(os.getppid(), signal.SIGUSR2)
        deadline = time.monotonic() + 20
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        return 75 if stopped else 1

    try:
        for _ in range(5):
            assert _run_forked(tmp_path, body) == 75
        assert stopped == []  # the parent forwarded it; it stops nothing of its own
        assert signal.getsignal(signal.SIGUSR2) is record  # and its handler is back
    finally:
        idle.set()
        helper.join()
        signal.signal(signal.SIGUSR2, previous)


def test_ranks_die_with_their_node_task(tmp_path):
    """A node task killed outright (SIGKILL: no forwarding, no reaping) must not leave its ranks
    running outside the job's process tree."""
    import subprocess
    import sys

    script = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from tests.launcher.test_worker_ranks import node_task
from worker.env import rank_infos
from worker.ranks import fork_ranks

def body(info):
    open({str(tmp_path)!r} + f"/pid{{info.global_rank}}", "w").write(str(os.getpid()))
    time.sleep(60)
    return 0

fork_ranks(rank_infos(node_task(0, nodes=1), 2), body, os._exit)
"""
    task = subprocess.Popen([sys.executable, "-c", script])
    pids = [tmp_path / f"pid{r}" for r in range(2)]
    deadline = time.monotonic() + 30
    while not all(p.exists() and p.read_text() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = [int(p.read_text()) for p in pids]
    task.kill()
    task.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in ranks)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("code", [-signal.SIGKILL, -signal.SIGTERM, 75])
def test_the_node_task_leaves_as_its_rank_did(code: int) -> None:
    """A rank killed by a signal kills its node task with it (SIGKILL's action cannot even be
    reset, which once turned the kill into a traceback and exit 1), so SLURM says "Killed"
    as when each rank was a task; a code is a code."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", f"from worker.ranks import leave; leave({code})"],
        cwd=repo, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
