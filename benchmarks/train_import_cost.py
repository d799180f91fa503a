"""Import cost of the training program: what every (re)start pays before the first step.

Runs each stage in a fresh interpreter, several times, and prints the median seconds as JSON:
`import torch`, then `megatron_runs.loop` (cpu_compat + megatron.core + our modules), and, for
contrast, what the supervisor pays to read checkpoints (`megatron_runs.checkpointing`).

    .venv/bin/python benchmarks/train_import_cost.py --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STAGES = {
    "torch": "import torch",
    "torch+megatron_runs.loop": "import megatron_runs.loop",
    "megatron_runs.checkpointing (supervisor side)": "import megatron_runs.checkpointing",
}

TIMER = (
    "import time, warnings; warnings.simplefilter('ignore'); t = time.perf_counter(); {stmt}; "
    "print(time.perf_counter() - t)"
)


def measure(stmt: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-c", TIMER.format(stmt=stmt)],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    result = {name: round(measure(stmt, args.repeat), 2) for name, stmt in STAGES.items()}
    print(json.dumps({"median_seconds": result, "repeat": args.repeat}))


if __name__ == "__main__":
    main()
