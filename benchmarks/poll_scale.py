"""How much one reconciler tick costs SLURM with many active jobs: one sacct call, measured.

Submits N sleeping one-node jobs (most stay PENDING on a small cluster — active all the same),
then polls them all M times through `SlurmCluster.poll`, counting the SLURM commands each tick
runs and timing it; for comparison it times one single-job poll (what a per-job poller pays N
times). Cancels everything at the end.

    SLURM_CONF=.cluster/etc/slurm.conf .venv/bin/python benchmarks/poll_scale.py --jobs 50
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

from supervisor.slurm import JobRequest, JobState, SlurmCluster, make_cluster


def measure(cluster: SlurmCluster, jobs: int, ticks: int, log_dir: Path) -> dict[str, object]:
    request = JobRequest(
        job_name="nw-poll-scale", log_dir=log_dir, nodes=1, tasks_per_node=1, time_limit_minutes=5
    )
    ids = [cluster.submit(request, functools.partial(time.sleep, 300)).job_id for _ in range(jobs)]
    try:
        calls, seconds, states = [], [], {}
        for _ in range(ticks):
            before, t0 = cluster.calls, time.perf_counter()
            statuses = cluster.poll(ids)
            seconds.append(time.perf_counter() - t0)
            calls.append(cluster.calls - before)
            states = {s: sum(st.state is s for st in statuses.values()) for s in JobState}
            time.sleep(0.2)
        t0 = time.perf_counter()
        cluster.poll(ids[:1])
        single = time.perf_counter() - t0
    finally:
        for job_id in ids:
            cluster.cancel(job_id)
    return {
        "jobs": jobs,
        "ticks": ticks,
        "calls_per_tick": max(calls),
        "tick_ms_median": round(1000 * statistics.median(seconds), 1),
        "tick_ms_max": round(1000 * max(seconds), 1),
        "single_job_poll_ms": round(1000 * single, 1),
        "per_job_polling_ms_estimate": round(1000 * single * jobs, 1),
        "states": {str(k): v for k, v in states.items() if v},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--ticks", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    cluster = make_cluster()
    if not isinstance(cluster, SlurmCluster):
        raise SystemExit("no SLURM controller answers (set SLURM_CONF; see docs/devcluster.md)")
    with tempfile.TemporaryDirectory(prefix="nw-poll-") as tmp:
        result = measure(cluster, args.jobs, args.ticks, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{result['jobs']} active jobs {result['states']}: {result['calls_per_tick']} SLURM call "
        f"per tick, median {result['tick_ms_median']} ms, max {result['tick_ms_max']} ms over "
        f"{result['ticks']} ticks; one single-job poll {result['single_job_poll_ms']} ms "
        f"(× {result['jobs']} ≈ {result['per_job_polling_ms_estimate']} ms per-job polling)"
    )


if __name__ == "__main__":
    main()
