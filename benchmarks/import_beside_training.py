"""What an idle node task's import costs the training beside it on shared CPUs, by priority.

On the dev cluster every node shares this machine's cores: a spare's, a standby successor's or
a reserve's node task imports the training program beside the training ranks, at the lowest
priority (`worker.priority.lowest_priority`). This trains the chaos soak's run (a tiny GPT,
TP 1 × PP 2 × DP 2, four ranks on CPU with gloo, no checkpoints) and meanwhile runs importers
one after another, each in a session of its own (its own autogroup, as a node's step is),
through `lowest_priority` ("lowest": nice 19, its autogroup too) or at its own priority
("own"), with a quiet window of `--quiet` seconds before each. The order of the kinds rotates
and turns around from one repeat to the next, so none always follows another. Per import: its
seconds, the steps trained meanwhile, and the seconds the training lost: the window's length
less its steps at the quiet windows' pace (their seconds over their steps).

    .venv/bin/python benchmarks/import_beside_training.py --repeats 4 --out /tmp/import.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chaos_soak import Mode, soak_spec  # noqa: E402
from contracts.logs import log_events  # noqa: E402
from worker.local_launch import launch  # noqa: E402

#: The importers: at the node task's own priority, and at the lowest as a spare imports.
KINDS = ("own", "lowest")

#: One importer: a session of its own, the node task's import under `lowest_priority`.
IMPORTER = (
    "import sys, warnings; warnings.simplefilter('ignore')\n"
    "from worker.priority import lowest_priority\n"
    "from worker.ranks import preload_module\n"
    "with lowest_priority(sys.argv[1] == 'lowest', {}):\n"
    "    preload_module('megatron_runs.train')\n"
)


def _import(kind: str) -> tuple[float, float]:
    """Start and end (epoch seconds) of one import of `kind` (KINDS), in a new session."""
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-c", IMPORTER, kind],
        cwd=ROOT,
        check=True,
        start_new_session=True,
        stderr=subprocess.DEVNULL,
    )
    return t0, time.time()


def _steps_within(stamps: list[float], start: float, end: float) -> int:
    return sum(start <= ts < end for ts in stamps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=4, help="imports of each kind")
    ap.add_argument("--quiet", type=float, default=8.0, help="seconds before each import")
    ap.add_argument("--out", type=Path, help="results JSON")
    ap.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "nightwatch-import-beside"
    )
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    spec = soak_spec(Mode((), 10**7, 10**7, ("nightwatch",)), None, {})
    spec["resources"]["nodes"] = 1
    spec["resources"]["spare_nodes"] = 0
    spec["resources"]["gpus_per_node"] = 4
    spec_path = args.work / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    run = launch(
        ["--spec", str(spec_path), "--checkpoint-dir", str(args.work / "ckpt")],
        4,
        args.work / "logs",
        entry=("-m", "megatron_runs.train"),
    )
    rank0 = args.work / "logs" / "rank0.log"
    try:
        while not any(e["event"] == "step" for e in log_events(_read(rank0))):
            if any(code is not None for code in run.poll()):
                raise SystemExit(_read(rank0)[-3000:])
            time.sleep(0.5)
        time.sleep(args.quiet)  # past the first steps' warm-up
        order = [p for i in range(args.repeats) for p in (KINDS[i:] + KINDS[:i])[:: 1 - i % 2 * 2]]
        windows: list[dict] = []
        for kind in order:
            quiet_start = time.time()
            time.sleep(args.quiet)
            windows.append({"kind": "quiet", "start": quiet_start, "end": time.time()})
            start, end = _import(kind)
            windows.append({"kind": kind, "start": start, "end": end})
            print(f"{kind}: import {end - start:.1f} s", flush=True)
        time.sleep(1.0)  # the last window's steps reach the log
    finally:
        run.kill()
    stamps = [e["ts"] for e in log_events(_read(rank0)) if e["event"] == "step"]
    for w in windows:
        w["seconds"] = w["end"] - w["start"]
        w["steps"] = _steps_within(stamps, w["start"], w["end"])
    quiet = [w for w in windows if w["kind"] == "quiet"]
    pace = sum(w["seconds"] for w in quiet) / sum(w["steps"] for w in quiet)
    for w in windows:
        w["lost_s"] = w["seconds"] - w["steps"] * pace
    summary = {
        kind: {
            "imports": len(ws := [w for w in windows if w["kind"] == kind]),
            "import_s_median": statistics.median(w["seconds"] for w in ws),
            "lost_s_median": statistics.median(w["lost_s"] for w in ws),
            "lost_s_each": [round(w["lost_s"], 2) for w in ws],
        }
        for kind in KINDS
    }
    data = {
        "cpus": os.cpu_count(),
        "quiet_step_s": pace,
        "quiet_lost_s_each": [round(w["lost_s"], 2) for w in quiet],
        "summary": summary,
        "windows": windows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1))
    print(json.dumps({k: v for k, v in data.items() if k != "windows"}, indent=1))


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


if __name__ == "__main__":
    main()
