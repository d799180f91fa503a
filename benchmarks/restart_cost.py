"""A restart's cost, side by side: one task per node forking its ranks vs one task per rank.

Both ways go through the same launcher and executor (the launcher's `LocalCluster`, submitit's
local executor, one node) and the real training program; they differ only in
`TrainingTask.ranks_per_task` (`worker.ranks`). One job trains `--warm` steps and saves; then
each repeat resumes from (a copy of) that checkpoint once each way, in alternating order, to
step `warm + 3`, and records the seconds from the submission to the resumed `train_start` (imports,
model, optimizer, checkpoint load) and to the first step. Prints JSON (medians and every run).

    .venv/bin/python benchmarks/restart_cost.py --repeat 3                 # CPU, the soak's job
    python benchmarks/restart_cost.py --gpus 2 --repeat 3 --out /tmp/rc    # GPUs, NCCL
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.soak.progress import parse_lines  # noqa: E402
from contracts.spec import RunSpec  # noqa: E402
from supervisor import launcher  # noqa: E402
from supervisor.slurm import LocalCluster, wait_for  # noqa: E402

WAYS = ("node_task_forks_ranks", "task_per_rank")


def spec(ranks: int, gpus: bool, data: dict[str, str], steps: int) -> RunSpec:
    """The soak's model (TP 1 × PP 2 × DP 2 on 4 CPU ranks); DP over the GPUs on a GPU host."""
    pipeline = 2 if not gpus and ranks % 2 == 0 else 1
    return RunSpec.model_validate(
        {
            "name": "restart-cost",
            "model": {
                "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                "vocab_size": 4096, "precision": "bf16" if gpus else "fp32",
            },
            "parallelism": {"tensor": 1, "pipeline": pipeline, "data": ranks // pipeline},
            "resources": {
                "device": "gpu" if gpus else "cpu", "nodes": 1, "gpus_per_node": ranks,
                "cpus_per_task": 1,
            },
            "training": {
                "train_steps": steps, "micro_batch_size": 2, "global_batch_size": 4 * ranks,
                "lr": 1.0e-3, "min_lr": 1.0e-4, "lr_warmup_steps": 2,
            },
            "data": data,
            "checkpoint": {"interval_steps": 1000, "keep_last": 2},
        }
    )  # fmt: skip


def one_job(
    cluster: LocalCluster, plan: launcher.SubmitPlan, way: str, timeout_s: float
) -> dict[str, float | int | None]:
    request, task = launcher.job_request(plan), launcher.training_task(plan)
    if way == "task_per_rank":
        ranks = request.ranks_per_task
        request = replace(request, tasks_per_node=ranks, ranks_per_task=1, cpus_per_task=1)
        task = replace(task, ranks_per_task=1, gpus_required=min(task.gpus_required, 1))
    t0 = time.time()
    sub = cluster.submit(request, task)
    done = wait_for(cluster, sub.job_id, lambda s: s.state.terminal, timeout_s=timeout_s)
    text = "\n".join(p.read_text(errors="replace") for p in cluster.log_files(sub.job_id))
    progress = parse_lines(text.splitlines())
    start = progress.starts[0].t if progress.starts else None
    first = progress.steps[0].t if progress.steps else None
    return {
        "exit_code": done.exit_code,
        "to_train_start_s": round(start - t0, 2) if start else None,
        "to_first_step_s": round(first - t0, 2) if first else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=0, help="ranks on GPUs (NCCL); 0: 4 CPU ranks")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warm", type=int, default=5, help="steps trained before the restarts")
    ap.add_argument("--out", type=Path, default=None, help="work dir (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="restart-cost-"))
    from megatron_runs.data_prep import prepare

    prepared = prepare(None, out / "data", 4096)
    data = {"prefix": prepared.prefix, "tokenizer": prepared.tokenizer_path}
    ranks = args.gpus or 4
    run_spec = spec(ranks, bool(args.gpus), data, args.warm + 3)
    cluster = LocalCluster()
    plan = launcher.SubmitPlan(
        run_id="restart-cost", attempt=1, spec=run_spec, checkpoint_dir=out / "ckpt",
        log_dir=out / "logs", metrics=False, stop_at_step=args.warm,
        env={"NIGHTWATCH_HOME": str(out / "home"), "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    warm = one_job(cluster, plan, WAYS[0], args.timeout)
    if warm["exit_code"] != 0:
        raise SystemExit(f"the first job failed: {warm}")
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for i in range(args.repeat):
        for way in WAYS if i % 2 == 0 else WAYS[::-1]:
            attempt = 2 + sum(len(r) for r in runs.values())
            ckpt = out / f"ckpt-a{attempt}"  # each resume from its own copy of the same save
            shutil.copytree(plan.checkpoint_dir, ckpt)
            resumed = replace(plan, attempt=attempt, checkpoint_dir=ckpt, stop_at_step=None)
            runs[way].append(one_job(cluster, resumed, way, args.timeout))
            print(json.dumps({"way": way, **runs[way][-1]}), flush=True)
            if runs[way][-1]["exit_code"] != 0:  # a broken way must not leave medians behind
                raise SystemExit(f"{way} failed: {runs[way][-1]}")
    medians = {
        way: {
            key: statistics.median(r[key] for r in rs if r[key] is not None)
            for key in ("to_train_start_s", "to_first_step_s")
        }
        for way, rs in runs.items()
    }
    import torch

    device = torch.cuda.get_device_name(0) if args.gpus else "cpu"
    print(json.dumps({"device": device, "ranks": ranks, "median": medians, "runs": runs}))


if __name__ == "__main__":
    main()
