"""A small trainer that keeps the training contract (docs/contracts.md), for launcher tests.

Why not Megatron here: the launcher tests exercise SLURM, the worker's rank setup, signals,
checkpoint/resume chaining and metrics discovery; a real torch.distributed (gloo) job that
all-reduces every step, checkpoints in the contract's on-disk format, exits 75 on USR2/TERM and
serves `nightwatch_train_step` shows all of that in seconds on two shared CPU cores. The real
Megatron trainer keeps the same contract and is tested by its own suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from contracts.restart import memory_tier_fds
from contracts.task import TrainContext

STEP_SECONDS = float(os.environ.get("TOY_STEP_SECONDS", "0.3"))
#: "RANK:STEP[:ATTEMPT]": that rank dies at that step (os._exit, like a SIGKILL: no cleanup),
#: in that attempt only when one is given.
CRASH_AT = os.environ.get("TOY_CRASH_AT")
#: "1": every rank keeps a thread the interpreter's teardown would wait for forever, as a
#: process group with a dead peer or a writer thread can make it do.
LINGER = os.environ.get("TOY_LINGER") == "1"


@dataclass
class TrainResult:
    exit_code: int
    step: int
    start_step: int
    world_size: int


def latest_step(ckpt: Path) -> int:
    marker = ckpt / "latest"
    return int(marker.read_text()) if marker.exists() else 0


def save(ckpt: Path, step: int, value: float, world: int) -> None:
    """Contract layout: write `.tmp_iter_N/`, rename to `iter_N/`, then the `latest` marker."""
    tmp = ckpt / f".tmp_iter_{step:07d}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "state.json").write_text(json.dumps({"value": value}))
    size = (tmp / "state.json").stat().st_size
    meta = {
        "step": step,
        "consumed_samples": step,
        "loss": value,
        "saved_at": time.time(),
        "layout": {"tensor": 1, "pipeline": 1, "data": world},
        "complete": True,
        "files": {"state.json": size},
    }
    (tmp / "nightwatch.json").write_text(json.dumps(meta))
    final = ckpt / f"iter_{step:07d}"
    shutil.rmtree(final, ignore_errors=True)  # a rolled-back run saves that step again
    os.replace(tmp, final)
    (ckpt / "latest.tmp").write_text(str(step))
    os.replace(ckpt / "latest.tmp", ckpt / "latest")


def train(spec, ctx: TrainContext) -> TrainResult:
    stop = {"flag": 0.0}

    def on_signal(signum, frame) -> None:
        stop["flag"] = 1.0

    signal.signal(signal.SIGUSR2, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    ckpt = Path(ctx.checkpoint_dir)
    start = ctx.resume_step if ctx.resume_step is not None else latest_step(ckpt)
    value = (
        json.loads((ckpt / f"iter_{start:07d}" / "state.json").read_text())["value"]
        if start
        else 0.0
    )
    registry = CollectorRegistry()
    labels = {"run_id": ctx.run_id, "attempt": str(ctx.attempt), "node": ctx.node}
    step_gauge = Gauge("nightwatch_train_step", "last step", list(labels), registry=registry)
    step_gauge.labels(**labels).set(start)
    if local_rank == 0 and ctx.metrics_port is not None:
        server, _ = start_http_server(ctx.metrics_port, addr="127.0.0.1", registry=registry)
        if ctx.on_metrics_ready:
            ctx.on_metrics_ready("127.0.0.1", server.server_port)
    target = min(spec.training.train_steps, ctx.stop_at_step or spec.training.train_steps)
    interval = spec.checkpoint.interval_steps
    step, code = start, 0
    print(f"toy: rank {rank}/{world} on {ctx.node} starts at step {start}", flush=True)
    # The memory tier's contract, not its format: each rank records its place and step in
    # its first slot, which the next attempt in the job must find there.
    slots = memory_tier_fds(os.environ)
    if slots:
        held = os.pread(slots[0], 64, 0).rstrip(b"\0").decode() or "nothing"
        print(f"toy: rank {rank} memory tier holds {held}", flush=True)
    if LINGER:
        threading.Thread(target=threading.Event().wait, name="linger").start()
    crash_at = [int(x) for x in CRASH_AT.split(":")] if CRASH_AT else []
    crash = tuple(crash_at[:2]) if crash_at[2:] in ([], [ctx.attempt]) and crash_at else None
    while step < target:
        time.sleep(STEP_SECONDS)
        if crash == (rank, step + 1):
            print(f"toy: rank {rank} crashes at step {step + 1}", flush=True)
            os._exit(9)
        t = torch.tensor([1.0, stop["flag"]])
        dist.all_reduce(t)
        if t[0].item() != world:
            raise RuntimeError(f"all_reduce gave {t[0].item()}, expected {world}")
        step += 1
        value += t[0].item()
        step_gauge.labels(**labels).set(step)
        if slots:
            os.pwrite(slots[0], f"rank {rank} step {step}".encode().ljust(64, b"\0"), 0)
        stopping = t[1].item() > 0
        if rank == 0 and (step % interval == 0 or step == target or stopping):
            save(ckpt, step, value, world)
        dist.barrier()
        if stopping and step < target:  # like the trainer: the last step completes the run
            print(f"toy: stop signal, checkpointed step {step}", flush=True)
            code = 75
            break
    dist.destroy_process_group()
    return TrainResult(exit_code=code, step=step, start_step=start, world_size=world)
