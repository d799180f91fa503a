"""Many runs of the async-save exactness check at once: does a trainer's checkpoint ever differ?

`tests/train/test_async_save.py` runs one synchronous and one asynchronous 8-step run (tiny
GPT, two CPU ranks, DP 2, a save every 2 steps) and wants every checkpoint byte for byte the
same. This runs that pair over and over, `--workers` pairs side by side for `--seconds`, each
run's checkpoints at steps 2, 4, 6 and 8 compared with one synchronous reference run's, and
its losses with the reference's. A run that differs keeps its logs under `--out`.

    python benchmarks/async_exact_repeat.py --out $OUT/async_exact --seconds 400 --workers 6

Runs on CPU only (CUDA_VISIBLE_DEVICES is emptied for the ranks).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "train"))

from train_helpers import VOCAB, spec_dict  # noqa: E402

from contracts import checkpoints  # noqa: E402
from worker.local_launch import LocalRun, launch  # noqa: E402

STEPS = (2, 4, 6, 8)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="summary.json and differing runs")
    ap.add_argument("--seconds", type=float, default=300.0, help="how long each worker goes on")
    ap.add_argument("--workers", type=int, default=2, help="sync/async pairs side by side")
    ap.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "nightwatch-async-exact"
    )
    return ap.parse_args(argv)


def _start(home: Path, name: str, async_save: bool, ckpt: Path) -> LocalRun:
    spec = spec_dict(name, tp=1, pp=1, dp=2, steps=8, interval=2)
    spec["checkpoint"]["async_save"] = async_save
    logs = ckpt.with_name(ckpt.name + "-work")
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {"NIGHTWATCH_HOME": str(home), "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    args = ["--spec", str(logs / "spec.yaml"), "--checkpoint-dir", str(ckpt)]
    return launch(args, 2, logs / "logs", env=env)


def _files(ckpt: Path, step: int) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in sorted(checkpoints.step_dir(ckpt, step).glob("*.distcp"))
    }


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    home = args.work / "home"
    code = (
        "from pathlib import Path; from megatron_runs.data_prep import prepare; "
        f"prepare(None, Path({str(home / 'data')!r}), {VOCAB})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    ref = _start(home, "sync", False, args.work / "ref")
    if ref.wait(300) != [0, 0]:
        raise SystemExit(ref.logs[0].read_text()[-3000:])
    ref_files = {s: _files(args.work / "ref", s) for s in STEPS}
    ref_losses = ref.losses()
    results: list[dict] = []

    def worker(w: int) -> None:
        end, i = time.time() + args.seconds, 0
        while time.time() < end:
            for mode in ("sync", "async"):
                ckpt = args.work / f"w{w}-{mode}{i}"
                run = _start(home, mode, mode == "async", ckpt)
                codes = run.wait(300)
                ok = codes == [0, 0]
                record = {
                    "worker": w, "pair": i, "mode": mode, "codes": codes,
                    "differing_steps": [s for s in STEPS if ok and _files(ckpt, s) != ref_files[s]],
                    "losses_equal": run.losses() == ref_losses,
                }  # fmt: skip
                results.append(record)
                print(json.dumps(record), flush=True)
                logs = ckpt.with_name(ckpt.name + "-work")
                if ok and record["losses_equal"] and not record["differing_steps"]:
                    shutil.rmtree(ckpt)
                    shutil.rmtree(logs)
                else:
                    shutil.copytree(logs, args.out / logs.name, dirs_exist_ok=True)
            i += 1

    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(worker, range(args.workers)))
    bad = [
        r for r in results if r["codes"] != [0, 0] or r["differing_steps"] or not r["losses_equal"]
    ]
    summary = {
        "runs": {m: sum(r["mode"] == m for r in results) for m in ("sync", "async")},
        "differing": {m: sum(r["mode"] == m for r in bad) for m in ("sync", "async")},
        "workers": args.workers,
        "seconds": args.seconds,
    }
    print(json.dumps(summary))
    (args.out / "summary.json").write_text(json.dumps({**summary, "results": results}, indent=1))


if __name__ == "__main__":
    main()
