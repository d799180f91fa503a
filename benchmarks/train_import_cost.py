"""Import cost of the training program: what every (re)start pays before the first step.

Runs each stage in fresh interpreters, several times, and prints the median seconds as JSON:
`import torch`, then `megatron_runs.loop` (cpu_compat + megatron.core + our modules) as a
plain import and as `megatron_runs.train.train` does it (`import_frozen`: the cyclic
collector off during the import), and, for contrast, what the supervisor pays to read checkpoints
(`contracts.checkpoints`). With `--concurrent N`, N interpreters import at once, as the
N ranks of one node do at every restart, and a stage's time is the slowest of them. The
stages alternate within each repeat, so their ratio is measured side by side.

    .venv/bin/python benchmarks/train_import_cost.py --repeat 3
    .venv/bin/python benchmarks/train_import_cost.py --repeat 5 --concurrent 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name → (untimed setup, timed statement)
STAGES = {
    "torch": ("pass", "import torch"),
    "torch+megatron_runs.loop": (
        "import importlib, megatron_runs.train",
        "importlib.import_module('megatron_runs.loop')",
    ),
    "torch+megatron_runs.loop, collector off (megatron_runs.train.import_frozen)": (
        "from megatron_runs.train import import_frozen",
        "import_frozen('megatron_runs.loop')",
    ),
    "contracts.checkpoints (supervisor side)": (
        "pass",
        "import contracts.checkpoints",
    ),
}

TIMER = (
    "import time, warnings; warnings.simplefilter('ignore'); {setup}; "
    "t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)"
)


def once(setup: str, stmt: str, concurrent: int) -> float:
    """Seconds of the slowest of `concurrent` interpreters running the stage at once."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TIMER.format(setup=setup, stmt=stmt)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        for _ in range(concurrent)
    ]
    times = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{stmt!r} exited {proc.returncode}")
        times.append(float(out.strip().splitlines()[-1]))
    return max(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=1, help="interpreters importing at once")
    args = ap.parse_args()
    times: dict[str, list[float]] = {name: [] for name in STAGES}
    for _ in range(args.repeat):
        for name, (setup, stmt) in STAGES.items():
            times[name].append(once(setup, stmt, args.concurrent))
    result = {name: round(statistics.median(ts), 2) for name, ts in times.items()}
    print(json.dumps({"median_seconds": result, **vars(args)}))


if __name__ == "__main__":
    main()
