"""From a scheduler task to a torch.distributed rank (pure where it can be).

Why: Megatron-Core reads the usual torch.distributed variables; SLURM and submitit's local
executor describe the task differently. `dist_env` turns a `TaskInfo` into those variables, so
the mapping is tested on plain data; `task_info` is the one place that reads the scheduler.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace

MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000
#: How far apart the ports of one job's successive in-job attempts lie (prime: a job's later
#: attempts do not land on the ports of the jobs numbered right after it).
MASTER_PORT_STRIDE = 1009


@dataclass(frozen=True)
class TaskInfo:
    job_id: str
    hostnames: tuple[str, ...]
    global_rank: int
    local_rank: int
    num_tasks: int
    num_nodes: int
    launch_addr: str | None = None
    folder: str | None = None
    #: The attempt an order started inside the job, 0 for the job's first (`contracts.restart`).
    generation: int = 0


def master_port(job_id: str, generation: int = 0) -> int:
    """Distinct per job (jobs share hosts), stable across a requeue of the same job, and new
    for each restart inside the job: the last attempt's store may still hold its port."""
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return MASTER_PORT_BASE + (int(digits) + generation * MASTER_PORT_STRIDE) % MASTER_PORT_SPAN


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return False
    return True


def master_addr(info: TaskInfo, resolves: Callable[[str], bool] = _resolves) -> str:
    """The first host of the allocation; its launch address when the name does not resolve.

    srun is launched from the batch host, which is the allocation's first node, so
    SLURM_LAUNCH_NODE_IPADDR is the same machine (the local test cluster's n1..nN are names
    without DNS entries, all on 127.0.0.1).
    """
    first = info.hostnames[0] if info.hostnames else "127.0.0.1"
    if info.launch_addr and not resolves(first):
        return info.launch_addr
    return first


def dist_env(info: TaskInfo, resolves: Callable[[str], bool] = _resolves) -> dict[str, str]:
    if info.num_tasks % max(info.num_nodes, 1):
        raise ValueError(f"{info.num_tasks} tasks do not divide over {info.num_nodes} nodes")
    return {
        "MASTER_ADDR": master_addr(info, resolves),
        "MASTER_PORT": str(master_port(info.job_id, info.generation)),
        "RANK": str(info.global_rank),
        "LOCAL_RANK": str(info.local_rank),
        "WORLD_SIZE": str(info.num_tasks),
        "LOCAL_WORLD_SIZE": str(info.num_tasks // max(info.num_nodes, 1)),
    }


def rank_infos(task: TaskInfo, ranks_per_task: int) -> list[TaskInfo]:
    """The ranks one scheduler task runs: rank `k` of task `t` is global rank `t * n + k`.

    With one task per node forking its node's ranks (`worker.ranks`), task `t` is node `t`, so
    ranks stay node-contiguous, as they are with one task per rank."""
    if ranks_per_task < 1:
        raise ValueError(f"ranks_per_task must be >= 1, not {ranks_per_task}")
    return [
        replace(
            task,
            global_rank=task.global_rank * ranks_per_task + k,
            local_rank=task.local_rank * ranks_per_task + k,
            num_tasks=task.num_tasks * ranks_per_task,
        )
        for k in range(ranks_per_task)
    ]


def task_info() -> TaskInfo:
    """Read the current task through submitit's JobEnvironment (SLURM or local)."""
    import submitit

    env = submitit.JobEnvironment()
    return TaskInfo(
        job_id=str(env.job_id),
        hostnames=tuple(env.hostnames),
        global_rank=env.global_rank,
        local_rank=env.local_rank,
        num_tasks=env.num_tasks,
        num_nodes=env.num_nodes,
        launch_addr=os.environ.get("SLURM_LAUNCH_NODE_IPADDR"),
        folder=str(env.paths.folder),
    )
