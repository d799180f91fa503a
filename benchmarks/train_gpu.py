"""GPU measurements of the training program (4 GPUs, NCCL, bf16); writes JSON results.

Phases (each starts its own ranks through worker.local_launch):
* tpcheck: a ~110M GPT for 50 steps as TP2×PP2 and as TP1×DP4 from the same (CPU-initialised,
  layout-independent) weights: max |Δloss| per step, and the replica checksum result
  (replica_mismatch events; TP-replicated params and DP replicas compared every 10 steps);
* dp4 / tp2: the 1.3B GPT (24 × 2048, seq 2048, global batch `--gbs`, 64 unless given) as
  DP4 or TP2×DP2, three ways side by side: the bare SDPA loop (benchmarks/train_baseline.py),
  train() without hooks (no metrics endpoint, no checksums) and train() with them (metrics
  endpoint + checksum every 10 steps); dp1 is the same on one GPU, where `train()` also checks
  local rank 0's own gradients before the (absent) reduction. Step time is the median of steps
  after the warm-up. More bare-loop variants switch off GPU defaults of `setup.build_model` for
  an A/B in the same call: `baseline-ag` without the fused kernels (param all-gather overlap
  only), `baseline-before` without either (the loop as first measured), `baseline-adam` with
  torch's foreach AdamW instead of the fused kernel, `baseline-nogemm` with Megatron's separate
  bias adds instead of biases inside the QKV / fc1 GEMMs. `--skip-final-checkpoint` kills the
  train() ranks once they have logged the last step (and its replica check, when one is due)
  instead of waiting for the final checkpoint, to save device time.

    python benchmarks/train_gpu.py --phase tpcheck dp4 --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from contracts.logs import log_events  # noqa: E402
from contracts.spec import RunSpec  # noqa: E402
from megatron_runs.schedule import H100_BF16_PEAK, flops_per_token  # noqa: E402
from worker.local_launch import launch  # noqa: E402

WARMUP = 5

#: GPT shapes by size (benchmarks/ckpt_save.py takes them too); tiny and 36m fit a CPU.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"layers": 4, "hidden": 64, "heads": 4, "seq": 64},
    "36m": {"layers": 6, "hidden": 512, "heads": 8, "seq": 256},
    "125m": {"layers": 12, "hidden": 768, "heads": 12, "seq": 1024},
    "350m": {"layers": 24, "hidden": 1024, "heads": 16, "seq": 1024},
    "1.3b": {"layers": 24, "hidden": 2048, "heads": 16, "seq": 2048},
}


def gpt(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    tp: int,
    pp: int,
    dp: int,
    steps: int,
    mbs: int,
    gbs: int,
    vocab: int = 32768,
) -> dict:
    return {
        "name": name,
        "model": {
            "num_layers": layers,
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "seq_length": seq,
            "vocab_size": vocab,
            "precision": "bf16",
        },
        "parallelism": {"tensor": tp, "pipeline": pp, "data": dp},
        "resources": {"nodes": 1, "gpus_per_node": tp * pp * dp},
        "training": {
            "train_steps": steps,
            "micro_batch_size": mbs,
            "global_batch_size": gbs,
            "lr": 3e-4,
            "min_lr": 3e-5,
            "lr_warmup_steps": 5,
            "log_interval": 1,
        },
        "checkpoint": {"interval_steps": 10_000, "keep_last": 1},
    }


def _events(log: Path) -> list[dict]:
    return log_events(log.read_text(errors="replace"))


def run(
    work: Path,
    spec: dict,
    extra: list[str],
    env: dict,
    baseline_steps: int | None = None,
    timeout: float = 400,
    skip_final_checkpoint: bool = False,
    check_every: int = 0,
) -> dict:
    shutil.rmtree(work, ignore_errors=True)  # never resume an earlier run's checkpoint
    work.mkdir(parents=True)
    spec_path = work / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    nproc = spec["resources"]["gpus_per_node"]
    if baseline_steps:
        entry = (str(ROOT / "benchmarks" / "train_baseline.py"),)
        args = ["--spec", str(spec_path), "--steps", str(baseline_steps), *extra]
    else:
        entry = ("-m", "megatron_runs.train")
        args = ["--spec", str(spec_path), "--checkpoint-dir", str(work / "ckpt"), *extra]
    t0 = time.time()
    lr = launch(args, nproc, work / "logs", env=env, entry=entry)
    last = spec["training"]["train_steps"]

    def stop_after_last_step(r: object) -> None:
        seen = {e["event"] for e in r.events() if e.get("step") == last}
        checked = seen & {"replica_check", "replica_mismatch"}
        if "step" in seen and (checked or not check_every or last % check_every):
            r.kill()

    try:
        codes = lr.wait(timeout, stop_after_last_step if skip_final_checkpoint else None)
    except TimeoutError:
        codes = ["timeout"]
    events = _events(work / "logs" / "rank0.log")
    steps = [e for e in events if e["event"] == "step"]
    times = [e["step_time"] for e in steps[WARMUP:]]
    rs = RunSpec.model_validate(spec)
    tokens = rs.training.global_batch_size * rs.model.seq_length
    med = statistics.median(times) if times else math.nan
    world = nproc
    result = {
        "name": spec["name"],
        "codes": codes,
        "wall_s": round(time.time() - t0, 1),
        "steps": len(steps),
        "step_time_median_s": med,
        "step_time_min_s": min(times) if times else math.nan,
        "tokens_per_s_per_gpu": tokens / med / world if times else math.nan,
        "mfu": flops_per_token(rs) * tokens / (med * world * H100_BF16_PEAK) if times else math.nan,
        "losses": [e.get("loss") for e in steps],
        "replica_checks_ok": sum(e["event"] == "replica_check" for e in events),
        "replica_mismatch_events": sum(e["event"] == "replica_mismatch" for e in events),
        "checkpoint_s": [e.get("seconds") for e in events if e["event"] == "checkpoint_saved"],
    }
    if codes != [0] * nproc and not skip_final_checkpoint:
        result["log_tail"] = (work / "logs" / "rank0.log").read_text(errors="replace")[-3000:]
    brief = ("name", "codes", "wall_s", "steps", "step_time_median_s", "mfu")
    print(json.dumps({"work": work.name, **{k: result[k] for k in brief}}), flush=True)
    return result


def tpcheck(out: Path, env: dict) -> dict:
    small = dict(**SIZES["125m"], steps=50, mbs=4, gbs=32)
    a = run(out / "tp2pp2", gpt("tp2pp2", tp=2, pp=2, dp=1, **small), [], env)
    b = run(out / "tp1dp4", gpt("tp1dp4", tp=1, pp=1, dp=4, **small), [], env)
    diffs = [
        abs(x - y)
        for x, y in zip(a["losses"], b["losses"], strict=False)
        if x is not None and y is not None
    ]
    return {
        "tp2pp2": a,
        "tp1dp4": b,
        "max_abs_loss_diff": max(diffs) if diffs else None,
        "final_losses": [a["losses"][-1:], b["losses"][-1:]],
    }


def big(
    out: Path,
    env: dict,
    name: str,
    tp: int,
    dp: int,
    mbs: int,
    steps: int,
    variants: list[str],
    skip_ckpt: bool = False,
    gbs: int = 64,
    profile: int = 0,
) -> dict:
    spec = gpt(
        name,
        **SIZES["1.3b"],
        tp=tp,
        pp=1,
        dp=dp,
        steps=steps,
        mbs=mbs,
        gbs=gbs,
    )
    res: dict = {"micro_batch_size": mbs, "global_batch_size": gbs}
    if "baseline-before" in variants:
        res["baseline_before"] = run(
            out / f"{name}-base0",
            spec,
            ["--no-fused", "--no-overlap-param-gather"],
            env,
            baseline_steps=steps,
        )
    if "baseline-ag" in variants:
        res["baseline_ag"] = run(
            out / f"{name}-base-ag", spec, ["--no-fused"], env, baseline_steps=steps
        )
    if "baseline" in variants:
        prof = ["--profile", str(profile)] if profile else []
        res["baseline"] = run(out / f"{name}-base", spec, prof, env, baseline_steps=steps)
    if "hooks" in variants:
        res["train_hooks"] = run(
            out / f"{name}-hooks",
            spec,
            ["--metrics-port", "0"],
            env,
            skip_final_checkpoint=skip_ckpt,
            check_every=10,
        )
    if "nohooks" in variants:
        res["train_no_hooks"] = run(
            out / f"{name}-nohooks",
            {**spec, "training": {**spec["training"], "replica_check_every": 0}},
            [],
            env,
            skip_final_checkpoint=skip_ckpt,
        )
    if "baseline-nogemm" in variants:
        res["baseline_nogemm"] = run(
            out / f"{name}-base-nogemm", spec, ["--no-gemm-bias"], env, baseline_steps=steps
        )
    if "baseline-adam" in variants:
        res["baseline_adam"] = run(
            out / f"{name}-base-adam", spec, ["--no-fused-adam"], env, baseline_steps=steps
        )
    if "train_no_hooks" in res and "train_hooks" in res:
        base = res["train_no_hooks"]["step_time_median_s"]
        res["hook_overhead_ratio"] = res["train_hooks"]["step_time_median_s"] / base - 1
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", nargs="+", choices=["tpcheck", "dp4", "tp2", "dp1"], required=True)
    ap.add_argument("--out", type=Path, required=True, help="work dir (checkpoints, logs)")
    ap.add_argument("--results", type=Path, help="results JSON (default OUT/results.json)")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--gbs", type=int, default=64, help="global batch of the 1.3B phases")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["baseline", "nohooks", "hooks"],
        choices=[
            "baseline-before",
            "baseline-ag",
            "baseline",
            "nohooks",
            "hooks",
            "baseline-adam",
            "baseline-nogemm",
        ],
    )
    ap.add_argument("--skip-final-checkpoint", action="store_true")
    ap.add_argument("--profile", type=int, default=0, help="profile the bare loop's last N steps")
    args = ap.parse_args()
    import torch

    env = {"NIGHTWATCH_HOME": str(args.out / "home"), "PYTHONWARNINGS": "ignore"}
    results = {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
    }
    for phase in args.phase:
        t0 = time.time()
        if phase == "tpcheck":
            results[phase] = tpcheck(args.out / phase, env)
        else:
            tp, dp = {"dp4": (1, 4), "tp2": (2, 2), "dp1": (1, 1)}[phase]
            key = f"{phase}_mbs{args.mbs}_gbs{args.gbs}"
            results[key] = big(
                args.out / key,
                env,
                phase,
                tp,
                dp,
                args.mbs,
                args.steps,
                args.variants,
                args.skip_final_checkpoint,
                args.gbs,
                args.profile,
            )
        results[f"{phase}_wall_s"] = round(time.time() - t0, 1)
        (args.results or args.out / "results.json").write_text(json.dumps(results, indent=1))
        print(json.dumps({k: v for k, v in results.items()}, default=str)[:6000], flush=True)


if __name__ == "__main__":
    main()
