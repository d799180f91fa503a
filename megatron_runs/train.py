"""Entry point of the training program: `train(spec, ctx)` and `python -m megatron_runs.train`.

This module stays import-light (no torch at import time) so the worker can build a
`TrainContext` cheaply; `train()` imports the heavy loop. The CLI is spawn-safe: checkpoint
saving starts a multiprocessing manager, which re-imports `__main__` under spawn.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from contracts import checkpoints
from contracts.paths import checkpoint_dir, nightwatch_home
from contracts.spec import RunSpec
from contracts.task import TrainContext, node_name


@dataclass
class TrainResult:
    exit_code: int
    final_step: int
    consumed_samples: int
    losses: list[float] = field(default_factory=list)


def train(spec: RunSpec, ctx: TrainContext) -> TrainResult:
    """Run (or resume) training on this rank; every rank of the job calls it."""
    use_run_compile_cache(ctx.checkpoint_dir)
    loop = import_frozen("megatron_runs.loop")
    return loop.run(spec, ctx)


def use_run_compile_cache(checkpoint_dir: Path) -> None:
    """Point TorchInductor's and Triton's caches at the run's folder (unless the environment
    already names one): they default to /tmp of the node, so every attempt on a fresh node
    compiled megatron's fused kernels again. Both read the variables when they compile."""
    cache = checkpoints.compile_cache_dir(checkpoint_dir)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))


def preload() -> None:
    """What every rank imports, for a launcher that imports once and forks the ranks
    (`worker.ranks`): the loop, and `torch._dynamo`, which torch.optim's `_disable_dynamo`
    wrappers import on the optimizer's first call (1.1 s a rank, docs/benchmarks.md)."""
    import_frozen("megatron_runs.loop")
    import_frozen("torch._dynamo")


def import_frozen(name: str) -> ModuleType:
    """Import with the cyclic collector off, then freeze every object that exists.

    torch and megatron-core build a few million long-lived objects on import, none of them
    garbage. Collected on the way, they cost ≈ 14 % of the import at every (re)start; left
    unfrozen, every full collection during training walks them again, and a checkpoint save
    allocates enough to trigger some (0.43 s a save frozen vs 0.64 s; docs/benchmarks.md, the
    eighth-session soak). Here, not in the worker, so every launcher's ranks train alike."""
    gc.disable()
    try:
        return importlib.import_module(name)
    finally:
        gc.freeze()
        gc.enable()


def _skip(text: str) -> tuple[int, int]:
    start, _, end = text.partition(":")
    try:
        return int(start), int(end)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--skip takes START:END, got {text!r}") from exc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_runs.train", description=__doc__)
    ap.add_argument("--spec", required=True, type=Path, help="RunSpec YAML or JSON")
    ap.add_argument("--run-id", default=os.environ.get("NIGHTWATCH_RUN_ID", "local"))
    ap.add_argument("--attempt", type=int, default=int(os.environ.get("NIGHTWATCH_ATTEMPT", "0")))
    ap.add_argument("--checkpoint-dir", type=Path)
    ap.add_argument("--resume-step", type=int)
    ap.add_argument("--skip", type=_skip, action="append", default=[], metavar="START:END")
    ap.add_argument("--metrics-port", type=int)
    ap.add_argument("--stop-at-step", type=int)
    ap.add_argument(
        "--signal-lead",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="the lead of the job's walltime warning (sbatch --signal=USR2@SECONDS): after it "
        "the ranks train on until --handover-file exists or the lead runs short (0: leave at once)",
    )
    ap.add_argument(
        "--handover-file",
        type=Path,
        help="after a stop signal, leave once this file exists (the next job is ready)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = RunSpec.from_file(args.spec)
    ckpt = args.checkpoint_dir or checkpoint_dir(nightwatch_home(), args.run_id, spec)
    ctx = TrainContext(
        run_id=args.run_id,
        attempt=args.attempt,
        node=node_name(),
        checkpoint_dir=ckpt,
        resume_step=args.resume_step,
        skip_ranges=args.skip,
        metrics_port=args.metrics_port,
        stop_at_step=args.stop_at_step,
        signal_lead_s=args.signal_lead,
        handover_ready=args.handover_file.exists if args.handover_file else None,
    )
    return train(spec, ctx).exit_code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo/NCCL groups and checkpoint worker threads can hang it.
    os._exit(code)
