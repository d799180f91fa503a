"""What building a blend's indices costs each rank (megatron_runs.blend builds them in memory
on every rank): seconds and peak resident memory, for a two-dataset blend of synthetic
indexed datasets (sparse .bin files: the indices read only the .idx) at growing run sizes.

    PYTHONPATH=$PWD python benchmarks/blend_index_build.py [--docs 1000000] [--steps 1000 ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _synthetic(prefix: Path, docs: int, seed: int) -> int:
    """An indexed dataset of `docs` documents of 200–1800 tokens (uint16); returns its tokens."""
    import numpy as np

    from megatron_runs.cpu_compat import stub_triton_kernels

    stub_triton_kernels()
    from megatron.core.datasets.indexed_dataset import _IndexWriter

    lengths = np.random.default_rng(seed).integers(200, 1801, size=docs, dtype=np.int32)
    with _IndexWriter(str(prefix) + ".idx", np.uint16) as writer:
        writer.write(lengths, None, np.arange(docs + 1, dtype=np.int64))
    with open(str(prefix) + ".bin", "wb") as fh:
        fh.truncate(int(lengths.sum()) * 2)
    return int(lengths.sum())


def _one(prefixes: list[str], steps: int, batch: int, seq: int) -> dict:
    """In this process: build, then report seconds and peak RSS."""
    from megatron_runs import cpu_compat

    cpu_compat.apply()
    from contracts.spec import RunSpec
    from megatron_runs import blend

    spec = RunSpec.model_validate({
        "name": "bench",
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "seq_length": seq, "vocab_size": 50304},
        "training": {"train_steps": steps, "global_batch_size": batch, "eval_interval": 1000,
                     "eval_iters": 10},
        "data": {"blend": [{"prefix": prefixes[0], "weight": 0.7},
                           {"prefix": prefixes[1], "weight": 0.3}], "split": "99,1"},
    })  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    train, _ = blend.build(spec)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "samples": steps * batch,
        "built": len(train.dataset),
        "seconds": round(seconds, 2),
        "peak_rss_gib": round(peak / 2**20, 2),
        "rss_growth_gib": round((peak - before) / 2**20, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=int, default=1_000_000, help="documents per dataset")
    ap.add_argument("--steps", type=int, nargs="+", default=[1000, 10_000, 50_000])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(json.loads(args.one), args.steps[0], args.batch, args.seq)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        prefixes = [str(Path(tmp) / f"d{i}") for i in (0, 1)]
        tokens = [_synthetic(Path(p), args.docs, seed=i) for i, p in enumerate(prefixes)]
        print(json.dumps({"docs_per_dataset": args.docs, "tokens": tokens, "seq": args.seq}))
        for steps in args.steps:
            cmd = [sys.executable, __file__, "--one", json.dumps(prefixes), "--steps", str(steps),
                   "--batch", str(args.batch), "--seq", str(args.seq)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
