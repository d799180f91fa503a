"""Per-GPU memory: `supervisor.layout.memory_estimate` against the measured peak, per layout.

Each layout trains the 1.3B GPT (24 × 2048, seq 2048, bf16) for a few steps on this host's
GPUs through the real training program (`benchmarks/memory_probe.py` wraps its CLI); the ranks
are stopped once the last step is logged, before the final checkpoint. The measured peak is the
largest over ranks of the device's used memory (PyTorch's pool, the CUDA context, NCCL); a
layout that runs out of memory is reported as such. Error = estimate / measured - 1. Each
layout also reports its median step time (steps 3-6) and MFU against the H100's bf16 peak, as
`benchmarks/train_gpu.py` does.

    python benchmarks/memory_calibration.py --out OUT_DIR [--layouts dp4-mb8 ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from contracts.spec import RunSpec  # noqa: E402
from megatron_runs.schedule import H100_BF16_PEAK, flops_per_token  # noqa: E402
from supervisor.layout import GB, memory_estimate  # noqa: E402
from worker.local_launch import launch  # noqa: E402

#: name → (tensor, pipeline, data, micro batch, distributed optimizer, sequence parallel,
#: recompute)
LAYOUTS: dict[str, tuple[int, int, int, int, bool, bool, str]] = {
    "dp4-mb8": (1, 1, 4, 8, True, False, "none"),
    "dp4-mb16": (1, 1, 4, 16, True, False, "none"),
    "dp4-mb8-nodistopt": (1, 1, 4, 8, False, False, "none"),
    "tp2dp2-mb8": (2, 1, 2, 8, True, False, "none"),
    "tp2dp2-mb8-sp": (2, 1, 2, 8, True, True, "none"),
    "pp2dp2-mb8": (1, 2, 2, 8, True, False, "none"),
    "tp2pp2-mb8": (2, 2, 1, 8, True, False, "none"),
    "dp2-mb8": (1, 1, 2, 8, True, False, "none"),
    "dp2-mb8-selective": (1, 1, 2, 8, True, False, "selective"),
    "dp2-mb8-full": (1, 1, 2, 8, True, False, "full"),
    "dp2-mb16-full": (1, 1, 2, 16, True, False, "full"),
    "tp2-mb8": (2, 1, 1, 8, True, False, "none"),
    "tp2-mb8-sp": (2, 1, 1, 8, True, True, "none"),
    "pp2-mb8": (1, 2, 1, 8, True, False, "none"),
    "pp2-mb8-vpp2": (1, 2, 1, 8, True, False, "none"),
}
#: Layouts with an interleaved pipeline: name → model chunks per pipeline rank.
VIRTUAL: dict[str, int] = {"pp2-mb8-vpp2": 2}
STEPS = 6
GLOBAL_BATCH = 64


def spec_for(name: str, gpu_memory_gib: float) -> dict:
    tp, pp, dp, mbs, distopt, sp, recompute = LAYOUTS[name]
    spec = {
        "name": f"mem-{name}",
        "model": {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
                  "seq_length": 2048, "vocab_size": 32768, "precision": "bf16"},
        "parallelism": {"tensor": tp, "pipeline": pp, "data": dp,
                        "distributed_optimizer": distopt, "sequence_parallel": sp},
        "resources": {"nodes": 1, "gpus_per_node": tp * pp * dp, "gpu_memory_gib": gpu_memory_gib},
        "training": {"train_steps": STEPS, "micro_batch_size": mbs,
                     "global_batch_size": GLOBAL_BATCH, "lr": 3e-4, "min_lr": 3e-5,
                     "lr_warmup_steps": 2, "log_interval": 1, "recompute": recompute},
        "checkpoint": {"interval_steps": 10_000, "keep_last": 1},
    }  # fmt: skip
    if name in VIRTUAL:
        spec["parallelism"]["virtual_pipeline"] = VIRTUAL[name]
    return spec


def measure(out: Path, name: str, gpu_memory_gib: float) -> dict:
    work = out / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spec = spec_for(name, gpu_memory_gib)
    (work / "spec.yaml").write_text(yaml.safe_dump(spec))
    nproc = spec["resources"]["gpus_per_node"]
    run = launch(
        ["--spec", str(work / "spec.yaml"), "--checkpoint-dir", str(work / "ckpt")],
        nproc, work / "logs", env={"NIGHTWATCH_MEMORY_PROBE": str(work / "probe")},
        entry=(str(ROOT / "benchmarks" / "memory_probe.py"),),
    )  # fmt: skip

    def stop_after_last_step(r: object) -> None:
        if any(e["event"] == "step" and e.get("step") == STEPS for e in r.events()):
            r.kill()

    try:
        codes = run.wait(600, stop_after_last_step)
    except TimeoutError:
        codes = ["timeout"]
    text = "".join(p.read_text(errors="replace") for p in run.logs)
    steps = [e for e in run.events() if e["event"] == "step"]
    peaks = [json.loads(p.read_text()) for p in sorted((work / "probe").glob("rank*.json"))]
    estimate = memory_estimate(RunSpec.model_validate(spec))
    result = {
        "layout": name,
        "spec": spec,
        "steps": len(steps),
        "oom": "OutOfMemoryError" in text or "CUDA out of memory" in text,
        "estimate_gb": round(estimate.total_bytes / GB, 2),
        "estimate_parts_gb": {k: round(v / GB, 2) for k, v in {
            "weights": estimate.weights_bytes, "gradients": estimate.gradients_bytes,
            "optimizer": estimate.optimizer_bytes, "activations": estimate.activations_bytes,
            "overhead": estimate.overhead_bytes}.items()},
        "estimate_fits": estimate.fits,
    }  # fmt: skip
    if peaks and len(steps) == STEPS:
        used = max(p["device_used"] for p in peaks)
        rs = RunSpec.model_validate(spec)
        step_s = statistics.median(e["step_time"] for e in steps[2:])
        tokens = rs.training.global_batch_size * rs.model.seq_length
        result.update(
            step_time_s=round(step_s, 4),
            mfu=round(flops_per_token(rs) * tokens / (step_s * nproc * H100_BF16_PEAK), 4),
            measured_gb=round(used / GB, 2),
            allocated_gb=round(max(p["allocated"] for p in peaks) / GB, 2),
            reserved_gb=round(max(p["reserved"] for p in peaks) / GB, 2),
            device_total_gb=round(peaks[0]["device_total"] / GB, 2),
            error=round(estimate.total_bytes / used - 1, 3),
        )
    elif not result["oom"]:
        result["codes"] = codes
        result["log_tail"] = run.logs[0].read_text(errors="replace")[-2000:]
    brief = {k: v for k, v in result.items() if k not in ("log_tail", "spec")}
    print(json.dumps(brief), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--gpus", type=int, default=4, help="skip layouts needing more GPUs")
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0, help="the card's, for `fits`")
    args = ap.parse_args()
    results = []
    for name in args.layouts:
        tp, pp, dp, *_ = LAYOUTS[name]
        if tp * pp * dp <= args.gpus:
            results.append(measure(args.out, name, args.gpu_memory_gib))
    (args.out / "memory_calibration.json").write_text(json.dumps(results, indent=1))
    print(f"{'layout':20} {'estimate':>9} {'measured':>9} {'reserved':>9} {'error':>7}")
    for r in results:
        if "measured_gb" in r:
            print(f"{r['layout']:20} {r['estimate_gb']:9.2f} {r['measured_gb']:9.2f} "
                  f"{r['reserved_gb']:9.2f} {r['error']:+7.1%}")  # fmt: skip
        else:
            print(f"{r['layout']:20} {r['estimate_gb']:9.2f} {'OOM' if r['oom'] else 'failed':>9}")


if __name__ == "__main__":
    main()
