"""What the per-run compile cache saves a restart: the same resume, cold cache against warm.

One short run trains to step 2 and checkpoints (its compiles fill the run's cache under the
checkpoint folder, `contracts.checkpoints.compile_cache_dir`). Then the same checkpoint is
resumed twice for 2 more steps, side by side in one call: once from a copy of the run folder
without the cache (what every restart on a fresh node paid before) and once with it. Reported
per resume: launch to `train_start` (its `setup_seconds` phases), and the first step's time,
which is where TorchInductor compiles megatron's fused kernels.

    python benchmarks/compile_cache.py --size 350m --nproc 2 --work /tmp/cc --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_gpu import SIZES, gpt  # noqa: E402
from contracts import checkpoints  # noqa: E402
from worker.local_launch import launch  # noqa: E402


def _launch(work: Path, spec: dict, ckpt: Path, nproc: int, name: str) -> dict:
    (work / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    t0 = time.time()
    run = launch(["--spec", str(work / f"{name}.yaml"), "--checkpoint-dir", str(ckpt)],
                 nproc, work / name)  # fmt: skip
    codes = run.wait(600)
    events = run.events()
    start = next(e for e in events if e["event"] == "train_start")
    steps = [e for e in events if e["event"] == "step"]
    return {
        "codes": codes,
        "wall_s": round(time.time() - t0, 2),
        "launch_to_train_start_s": round(start["ts"] - t0, 2),
        "setup_seconds": start["setup_seconds"],
        "first_step_s": steps[0]["step_time"] if steps else None,
        "later_steps_s": [e["step_time"] for e in steps[1:]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="350m")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    spec = gpt(f"cc-{args.size}", tp=1, pp=1, dp=args.nproc, steps=2, mbs=1, gbs=args.nproc,
               **SIZES[args.size])  # fmt: skip
    first = args.work / "run" / "checkpoints"
    results = {"size": args.size, "nproc": args.nproc,
               "first": _launch(args.work, spec, first, args.nproc, "first")}  # fmt: skip
    cold = args.work / "cold" / "checkpoints"
    shutil.copytree(first, cold, ignore=shutil.ignore_patterns(checkpoints.COMPILE_CACHE_NAME))
    spec["training"]["train_steps"] = 4
    results["resume_cold_cache"] = _launch(args.work, spec, cold, args.nproc, "resume-cold")
    results["resume_warm_cache"] = _launch(args.work, spec, first, args.nproc, "resume-warm")
    args.out.write_text(json.dumps(results, indent=1))
    for name in ("first", "resume_cold_cache", "resume_warm_cache"):
        r = results[name]
        print(f"{name:18} launch→train_start {r['launch_to_train_start_s']:7.2f} s   "
              f"first step {r['first_step_s']} s   codes {r['codes']}")  # fmt: skip


if __name__ == "__main__":
    main()
