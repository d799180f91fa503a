"""How to get a save's device state to host memory without stalling training (GPU only).

A process's first asynchronous save pins its host buffers, and the loop waits for that
(`megatron_runs.async_save`: 11-13 s for the 17 GiB of a 1.3B model on an H200). This measures,
in one process and side by side, what each way of taking that copy costs: the seconds the
training thread is held, and how much slower the steps that run beside the copy get.

* `pin`: pin fresh host buffers, then copy on a side stream (what the first save does now);
* `pinned_reuse`: copy into buffers pinned before (what later saves do);
* `clone_pageable_thread`: clone the state on the device (one device-to-device copy, the only
  wait), then a thread copies the clone into pageable host memory while training goes on;
* `pageable_thread`: a thread copies the live state into pageable memory (unsafe for a real
  save, which the optimizer's update would race; shows what a pageable copy costs by itself);
* `register_touched`: page-lock (cudaHostRegister) host memory whose pages were already
  touched (as memory another process, e.g. the node task, filled beforehand would be), then
  copy into it: the part of pinning that is not page allocation;
* `register_shm`: the same with a shared-memory file (/dev/shm) filled by another process.

Training is a stand-in: bf16 matmuls on the default stream, timed per step.

    python3 benchmarks/host_copy_gpu.py --gib 17 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch


def state(gib: float, chunk_mib: int = 256) -> list[torch.Tensor]:
    n = int(gib * 1024 / chunk_mib)
    return [torch.randn(chunk_mib * 1024 * 1024 // 4, device="cuda") for _ in range(n)]


class Trainer:
    def __init__(self) -> None:
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def step(self) -> float:
        t = time.perf_counter()
        for _ in range(150):
            self.a = (self.a @ self.b).clamp_(-1, 1)
        torch.cuda.synchronize()
        return time.perf_counter() - t


def steps_while(trainer: Trainer, busy: threading.Thread | None, least: int = 5) -> list[float]:
    times = []
    while (busy is not None and busy.is_alive()) or len(times) < least:
        times.append(trainer.step())
    return times


def run(way: str, tensors: list[torch.Tensor], trainer: Trainer, pinned: list) -> dict:
    stream = torch.cuda.Stream()
    held = time.perf_counter()
    copy_s: dict[str, float] = {}
    if way in ("pin", "pinned_reuse"):
        if way == "pin" or not pinned:
            pinned[:] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for h, t in zip(pinned, tensors, strict=True):
                h.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        held_s = time.perf_counter() - held

        def waiter() -> None:
            t0 = time.perf_counter()
            done.synchronize()
            copy_s["copy"] = time.perf_counter() - t0

        busy = threading.Thread(target=waiter)
    else:
        sources = tensors
        if way == "clone_pageable_thread":
            sources = [t.clone() for t in tensors]
            torch.cuda.synchronize()
        held_s = time.perf_counter() - held

        def copier() -> None:
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                hosts = [t.to("cpu") for t in sources]
            copy_s["copy"] = time.perf_counter() - t0
            copy_s["bytes"] = sum(h.numel() * h.element_size() for h in hosts)

        busy = threading.Thread(target=copier)
    busy.start()
    times = steps_while(trainer, busy)
    busy.join()
    return {"way": way, "held_s": round(held_s, 3), "copy_s": round(copy_s.get("copy", 0), 3),
            "steps_beside": len(times), "step_median_s": round(statistics.median(times), 4),
            "step_sum_s": round(sum(times), 3)}  # fmt: skip


def register(way: str, tensors: list[torch.Tensor]) -> dict:
    """Page-lock already-populated host memory, then copy the state into it."""
    import mmap
    import os
    import subprocess

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if way == "register_shm":
        path = "/dev/shm/nw-host-copy"
        count = -(-nbytes // (64 << 20))
        dd = ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}"]
        subprocess.run(dd, check=True, capture_output=True)
        fd = os.open(path, os.O_RDWR)
        buf = mmap.mmap(fd, nbytes)
        os.close(fd)
        host = torch.frombuffer(buf, dtype=torch.uint8)
        populate = time.perf_counter()
        host[::4096].zero_()  # map this process's page tables (the pages exist already)
        mapped_s = time.perf_counter() - populate
    else:
        host = torch.zeros(nbytes, dtype=torch.uint8)
        mapped_s = 0.0
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    err = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
    register_s = time.perf_counter() - t0
    views, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(host[offset : offset + n].view(t.dtype).view(t.shape))
        offset += n
    t0 = time.perf_counter()
    for v, t in zip(views, tensors, strict=True):
        v.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0
    cudart.cudaHostUnregister(host.data_ptr())
    if way == "register_shm":
        os.unlink("/dev/shm/nw-host-copy")
    return {"way": way, "error": int(err), "map_s": round(mapped_s, 3),
            "held_s": round(register_s, 3), "copy_s": round(copy_s, 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=17.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trainer = Trainer()
    tensors = state(args.gib)
    for _ in range(3):
        trainer.step()
    base = steps_while(trainer, None, least=10)
    result = {"card": torch.cuda.get_device_name(0), "gib": args.gib,
              "step_alone_s": round(statistics.median(base), 4), "ways": []}  # fmt: skip
    pinned: list = []
    for way in ("pageable_thread", "clone_pageable_thread", "pin", "pinned_reuse"):
        r = run(way, tensors, trainer, pinned)
        r["extra_step_s"] = round(r["step_sum_s"] - r["steps_beside"] * result["step_alone_s"], 3)
        result["ways"].append(r)
        print(json.dumps(r), flush=True)
    for way in ("register_touched", "register_shm"):
        r = register(way, tensors)
        result["ways"].append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_copy.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
