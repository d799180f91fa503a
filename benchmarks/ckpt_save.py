"""Checkpoint save cost, Nightwatch's path against plain Megatron-Core, on one model state.

Every repeat, on the same GPT + distributed-optimizer state (data parallel over all ranks,
Adam moments filled by a few optimizer steps on random gradients), for each optimizer format
of `--formats` (`dist_ckpt.FORMATS`; rows named `path:format`):

* `nightwatch`: `dist_ckpt.Writer.save` as the training loop calls it, by phase (fresh temp
  dir, state dict, megatron's write, fsyncs, metadata, publish rename + `latest`, retention,
  the closing all-reduce);
* `rank0`: the same with `spread_replicas=False` (megatron's default strategy: data-parallel
  rank 0 writes every replicated tensor), after `nightwatch` in even repeats, before it in odd;
* `plain_cached` (asked for by `--paths`): `plain` with the strategy nightwatch's saves use
  without the replica spreading (cached metadata, integrity validated on the first save
  only), beside `plain`;
* `plain`: the sharded state dict of the first format through `dist_checkpointing.save` with
  its default strategy into a fresh directory (no metadata, no publish); first in even
  repeats, last in odd ones, so neither path always writes behind the other's page cache;
* `async`: `Writer.start`, then training steps while the save runs, each polling it, until
  it is durable and published. A step is `--compute-ms` of matrix products (a stand-in for
  forward and backward) and a real optimizer update, and ends with a device sync as the
  loop's loss readout does, so no step's device work is counted as a poll's. `stall_s`: the
  time the loop was blocked in the save's calls (start + every poll); `slowdown_s`: how much
  longer the steps meanwhile took than the median step before the save (a copy or a writer
  competing with training); `durable_s`: from the start until published; `copy_s`: the
  device time of the copy to host memory, where the code reports it;
* `load`: `dist_ckpt.load` of the checkpoint the async save just published; `exact:<format>`
  whether every parameter and optimizer tensor loaded equals the state at the save's start
  (the steps meanwhile changed them, so a copy that read an updated tensor shows here);
* `d2h` (`--d2h`): this rank's state tensors copied to host memory alone: megatron's way
  (`.to("cpu", non_blocking=True)` each, then one sync), into pinned buffers allocated
  before, and into pageable memory.

Runs on CPU (gloo, fp32) and on GPU (NCCL, bf16). It starts its own ranks
(worker.local_launch) unless it runs under torchrun:

    python benchmarks/ckpt_save.py --size 1.3b --nproc 4 --repeats 3 --out $OUT/ckpt_save.json
    python benchmarks/ckpt_save.py --size 125m --formats fully_sharded_model_space
    torchrun --nproc-per-node 4 benchmarks/ckpt_save.py --size 1.3b --out $OUT/ckpt_save.json

Checkpoints go to `--work` (never under $OUT: they are the size of the state, 17 GiB for 1.3B).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_gpu import SIZES, gpt  # noqa: E402


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start (not under torchrun)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--formats",
        nargs="+",
        default=["fully_sharded_model_space", "fully_reshardable"],
        help="optimizer formats to save in (dist_ckpt.FORMATS), each measured every repeat",
    )
    ap.add_argument(
        "--paths",
        nargs="+",
        default=["plain", "nightwatch", "async"],
        help="which saves to measure (async is followed by its load)",
    )
    ap.add_argument("--keep-last", type=int, default=1, help="checkpoints nightwatch's saves keep")
    ap.add_argument("--compute-ms", type=float, default=0.0, help="stand-in fwd/bwd per step")
    ap.add_argument("--d2h", action="store_true", help="time the copy to host memory alone")
    ap.add_argument("--out", type=Path, help="results JSON")
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "nightwatch-ckpt-save",
        help="checkpoint directories (emptied first)",
    )
    return ap.parse_args(argv)


def main() -> None:
    args = _args()
    if "RANK" in os.environ:
        _rank_main(args)
        return
    from worker.local_launch import launch

    shutil.rmtree(args.work, ignore_errors=True)
    result = args.work / "result.json"
    argv = [
        "--size", args.size, "--repeats", str(args.repeats), "--work", str(args.work),
        "--out", str(result), "--formats", *args.formats, "--paths", *args.paths,
        "--compute-ms", str(args.compute_ms), "--keep-last", str(args.keep_last),
        *(["--d2h"] if args.d2h else []),
    ]  # fmt: skip
    run = launch(argv, args.nproc, args.work / "logs", entry=(str(Path(__file__).resolve()),))
    codes = run.wait(3600)
    if codes != [0] * args.nproc or not result.exists():
        print((args.work / "logs" / "rank0.log").read_text(errors="replace")[-4000:])
        raise SystemExit(f"ranks exited {codes}")
    data = json.loads(result.read_text())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1))
    print(_table(data))


def _table(data: dict) -> str:
    """Median seconds per repeat, one row per measured path and phase."""
    rows = [f"{data['size']} on {data['world']} × {data['device']}, {data['gib']:.2f} GiB state"]
    if data.get("d2h"):
        rows.append(f"copy to host alone: {json.dumps(data['d2h'])}")

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):8.3f}" if values else "       -"

    for path, runs in data["repeats"].items():
        if path.startswith(("load", "exact")) or not runs or not isinstance(runs[0], dict):
            rows.append(f"{path:<40}{runs}")
            continue
        rows.append(f"{path:<40}{median([r['total_s'] for r in runs])}")
        for phase in runs[0]["phases"] if runs else []:
            rows.append(f"  {phase:<38}{median([r['phases'][phase] for r in runs])}")
        for key in ("stall_s", "slowdown_s", "copy_s", "durable_s", "max_poll_s"):
            if runs and runs[0].get(key) is not None:
                rows.append(f"  {key:<38}{median([r[key] for r in runs])}")
    return "\n".join(rows)


def _rank_main(args: argparse.Namespace) -> None:
    from megatron_runs import loop, setup
    from megatron_runs.cpu_compat import collective_device
    from megatron_runs.optimizer import build_optimizer, fuse_adam

    torch = setup.torch
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from contracts import checkpoints as ck
    from contracts.spec import RunSpec
    from megatron_runs import dist_ckpt

    rank, world, _, _ = setup.init_distributed()
    ps.initialize_model_parallel(1, 1)
    raw = gpt(
        f"ckpt-{args.size}", tp=1, pp=1, dp=world, steps=10, mbs=1, gbs=world, **SIZES[args.size]
    )
    raw["resources"]["device"] = "cpu" if setup.CPU else "gpu"
    bf16 = not setup.CPU
    raw["model"]["precision"] = "bf16" if bf16 else "fp32"
    spec = RunSpec.model_validate(raw)
    torch.manual_seed(1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    model, _ = setup.build_model(spec, bf16)
    optimizer = build_optimizer(spec, model, bf16)

    compute = _compute(torch, args.compute_ms)

    def train_step() -> None:
        """A stand-in step: `--compute-ms` of matrix products, random gradients, a real
        optimizer update of every parameter, a device sync (the loop's loss readout)."""
        compute()
        for chunk in model:
            for buf in chunk.buffers:
                buf.grad_data.normal_(0, 1e-3)
        optimizer.step()
        loop.finish_param_gather(model)
        if not setup.CPU:
            torch.cuda.synchronize()

    for _ in range(2):
        train_step()
    nbytes = _state_bytes(model, optimizer)
    layout = {"tensor": 1, "pipeline": 1, "data": world}
    work = args.work
    plain_dir = work / "plain"
    writers = {
        (path, fmt): dist_ckpt.Writer(fmt, spread_replicas=path != "rank0")
        for path in ("nightwatch", "rank0")
        for fmt in args.formats
    }
    results: dict = {p: [] for p in ("plain", "plain_cached") if p in args.paths}
    for fmt in args.formats:
        for path in ("nightwatch", "rank0", "async", "load", "exact"):
            if path in args.paths or ("async" in args.paths and path in ("load", "exact")):
                results[f"{path}:{fmt}"] = []

    def barrier_time() -> float:
        torch.distributed.barrier()
        if not setup.CPU:
            torch.cuda.synchronize()
        return time.perf_counter()

    def nightwatch(step: int, path: str, fmt: str) -> dict:
        phases = dist_ckpt.Phases()
        t0 = barrier_time()
        phases.mark("start")
        target = dist_ckpt.Target(
            work / fmt, step, step * world, 1.0, layout, keep_last=args.keep_last
        )
        writers[path, fmt].save(model, optimizer, target, phases)
        total = barrier_time() - t0
        phases.seconds.pop("start")
        return {"total_s": total, "phases": phases.seconds}

    cached = TorchDistSaveShardedStrategy(cached_metadata=True)
    plain_saves: list[Path] = []
    cached_saves: list[Path] = []

    def plain(path: str) -> dict:
        directory = plain_dir / str(len(plain_saves))
        if rank == 0:
            directory.mkdir(parents=True)
        t0 = barrier_time()
        state = dist_ckpt._state_dict(
            model, optimizer, is_loading=False, optimizer_format=args.formats[0]
        )
        t1 = time.perf_counter()
        if path == "plain":
            dist_checkpointing.save(state, str(directory))
        else:
            dist_checkpointing.save(
                state, str(directory), cached, validate_access_integrity=not cached_saves
            )
            cached_saves.append(directory)
        t2 = barrier_time()
        # the previous plain checkpoint goes once this one is written, as retention removes
        # nightwatch's (keep_last 1): removed at once, its pages not yet on disk would be
        # dropped and the next save spared their writeback, which nightwatch's saves pay
        if rank == 0 and plain_saves:
            shutil.rmtree(plain_saves[-1], ignore_errors=True)
        plain_saves.append(directory)
        return {"total_s": t2 - t0, "phases": {"state_dict": t1 - t0, "save": t2 - t1}}

    def timed_step() -> float:
        t0 = time.perf_counter()
        train_step()
        return time.perf_counter() - t0

    def async_save(step: int, fmt: str) -> tuple[dict, list]:
        before = statistics.median(timed_step() for _ in range(5))
        snapshot = [t.detach().clone() for t in _state_tensors(model, optimizer)]
        phases = dist_ckpt.Phases()
        t0 = barrier_time()
        phases.mark("start")
        target = dist_ckpt.Target(
            work / fmt, step, step * world, 1.0, layout, keep_last=args.keep_last
        )
        pending = writers["nightwatch", fmt].start(model, optimizer, target, phases)
        started = time.perf_counter() - t0
        polls, slowdown = [], 0.0
        while True:
            slowdown += timed_step() - before
            polled = time.perf_counter()
            done = pending.poll()
            polls.append(time.perf_counter() - polled)
            if done is not None:
                break
        durable = time.perf_counter() - t0
        phases.seconds.pop("start")
        stall = started + sum(polls)
        return {
            "total_s": durable, "stall_s": stall, "start_s": started, "slowdown_s": slowdown,
            "durable_s": durable, "max_poll_s": max(polls), "publish_poll_s": polls[-1],
            "steps_meanwhile": len(polls), "step_before_s": before,
            "copy_s": getattr(pending, "copy_seconds", None), "phases": phases.seconds,
        }, snapshot  # fmt: skip

    def exact(snapshot: list) -> bool:
        """Every state tensor equal to the snapshot, on every rank."""
        now = _state_tensors(model, optimizer)
        same = all(torch.equal(a, b) for a, b in zip(snapshot, now, strict=True))
        flag = torch.tensor([int(same)], device=collective_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    step = 2
    d2h = _d2h(torch, _state_tensors(model, optimizer)) if args.d2h and not setup.CPU else None
    for i in range(args.repeats):
        # plain goes first on even repeats and last on odd ones: a save that follows another
        # writes while the page cache still flushes the one before it
        plain_last = i % 2 == 1
        plains = [p for p in ("plain", "plain_cached") if p in args.paths]
        for path in plains if not plain_last else []:
            results[path].append(plain(path))
        formats = args.formats if i % 2 == 0 else args.formats[::-1]
        writes = ("nightwatch", "rank0") if i % 2 == 0 else ("rank0", "nightwatch")
        for fmt in formats:
            for path in writes:
                if path in args.paths:
                    step += 1
                    results[f"{path}:{fmt}"].append(nightwatch(step, path, fmt))
            if "async" not in args.paths:
                continue
            step += 1
            measured, snapshot = async_save(step, fmt)
            results[f"async:{fmt}"].append(measured)
            t0 = barrier_time()
            dist_ckpt.load(model, optimizer, ck.newest_complete(work / fmt))
            results[f"load:{fmt}"].append(barrier_time() - t0)
            results[f"exact:{fmt}"].append(exact(snapshot))
            del snapshot
            fuse_adam(optimizer)
        for path in plains[::-1] if plain_last else []:
            results[path].append(plain(path))
        if rank == 0:
            print(json.dumps({"repeat": i, **{k: v[-1] for k, v in results.items()}}), flush=True)
    if rank == 0:
        data = {
            "size": args.size,
            "world": world,
            "device": "cpu" if setup.CPU else torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "gib": nbytes / 2**30,
            "formats": args.formats,
            "compute_ms": args.compute_ms,
            "d2h": d2h,
            "repeats": results,
        }
        args.out.write_text(json.dumps(data, indent=1))
        print(_table(data), flush=True)
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


def _state_tensors(model: list, optimizer: object) -> list:
    """This rank's parameters and optimizer state (main params, Adam moments): what a save
    reads and an optimizer update changes."""

    out = [p for c in model for p in c.parameters()]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            for p in group["params"]:
                state = inner.state.get(p, {})
                out += [p] + [state[k] for k in sorted(state) if k != "step"]
    return out


def _compute(torch: object, ms: float) -> object:
    """A stand-in for forward and backward: about `ms` of bf16 matrix products on the GPU."""
    if ms <= 0 or not torch.cuda.is_available():
        return lambda: None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ a  # the first product also sets cuBLAS up: not timed
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    n = max(1, round(ms / ((time.perf_counter() - t0) * 100)))

    def run() -> None:
        for _ in range(n):
            a @ a

    return run


def _d2h(torch: object, tensors: list) -> dict:
    """Seconds to copy `tensors` to host memory, three ways (the second try of each)."""
    gib = sum(t.numel() * t.element_size() for t in tensors) / 2**30
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

    def timed(copy: object) -> float:
        out = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out[-1]

    def megatron() -> None:
        [t.to("cpu", non_blocking=True) for t in tensors]

    def preallocated() -> None:
        for host, t in zip(pinned, tensors, strict=True):
            host.copy_(t, non_blocking=True)

    def pageable() -> None:
        [t.to("cpu") for t in tensors]

    seconds = {"megatron_s": timed(megatron), "pinned_preallocated_s": timed(preallocated)}
    seconds["pageable_s"] = timed(pageable)
    return {"gib": gib, **seconds, **{k[:-2] + "_gib_per_s": gib / v for k, v in seconds.items()}}


def _state_bytes(model: list, optimizer: object) -> int:
    """Bytes of the model's parameters and the whole optimizer state (all ranks together)."""
    import torch

    from megatron_runs.cpu_compat import collective_device

    params = sum(p.numel() * p.element_size() for c in model for p in c.parameters())
    local = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            local += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        for group in getattr(opt, "shard_fp32_from_float16_groups", []):
            local += sum(t.numel() * t.element_size() for t in group)
    total = torch.tensor([float(local)], device=collective_device())
    torch.distributed.all_reduce(total)
    return params + int(total.item())


if __name__ == "__main__":
    main()
