"""An asynchronous save's background part: the copy to host memory beside training, then the
forked writer.

Megatron-Core 0.19.2's async save copies every tensor a rank writes to host memory and
synchronizes the device before it forks the writer, so the loop stalls for the whole copy:
the 17 GiB state of a 1.3B model at DP 1 goes over PCIe once per save (0.35 s at 51 GiB/s on an
H200). Here the copy goes into pinned host buffers kept between saves (`HostBuffers`), on a
side stream that first waits for the work queued so far, and training goes on meanwhile. The
only writes to what a save reads are the optimizer's update (main params, Adam moments, then
the model's params copied from them): a step pre-hook on each inner torch optimizer makes the
device wait for the copy before that update, and the host does not block. The first poll after
the copy finished forks the writer from the host copy. Megatron-LM's persistent async worker
does the same copy in its worker process but holds the trainer until it is done
(`preload_q.join()`).

A process's first save pins the buffers before the copy, and the loop waits for that (11–13 s
for 17 GiB on the H200 machine, as megatron's first save). Pinning them on a thread instead,
from a clone on the device, took the stall to 0.6 s but made the steps meanwhile 8.6 s slower
in all (the pinning holds up the training thread), for 17 GiB more device memory: not kept.

With `overlap_param_gather` (DP > 1) the next forward pass may all-gather the parameters again
while the copy reads them: the gather writes the bytes they already hold (no update came in
between, `finish_param_gather` ran before the save), so the copy reads the same values.

Publishing is unchanged: only after every rank's writer finished, megatron's finalize wrote the
metadata and rank 0 made it durable (`publish`). A rank that dies before that leaves a temp dir
that never looks complete.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import multiprocessing as mp

from megatron_runs.cpu_compat import collective_device

#: megatron's write buckets: (file path, storage key, (bytes items, tensor items)).
Bucket = tuple[str, str, tuple[list, list]]


class HostBuffers:
    """Host tensors a rank's saves copy into, kept between saves: pinning 17 GiB took 11 s on
    the H200 machine, and megatron's own copy allocates them anew each save (from torch's
    pinned-memory cache, which keeps them anyway). Reused while the tensors' shapes and dtypes
    stay the same."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._tensors: list[torch.Tensor] = []

    def like(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One buffer per tensor, in order; allocated anew only if the layout changed."""
        if _layout(self._tensors) != _layout(tensors):
            self._tensors = []  # free the old buffers before pinning new ones
            self._tensors = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin) for t in tensors
            ]
        return self._tensors


def _layout(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype]]:
    return [(t.shape, t.dtype) for t in tensors]


class Staging:
    """The device tensors of a save on their way to host buffers, on a side stream; the
    optimizer's update waits for the copy on the device (`done`). A process's first save pins
    the buffers first, and the loop waits for that (11–13 s for 17 GiB on the H200 machine)."""

    def __init__(self, buckets: list[Bucket], buffers: HostBuffers, stream: object) -> None:
        # what the copy reads, kept until it is done
        self._sources = [t for _, _, (_, tensors) in buckets for _, t in tensors if t.is_cuda]
        hosts = buffers.like(self._sources)
        self._started = torch.cuda.Event(enable_timing=True)
        self.done = torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._started.record()
            for host, tensor in zip(hosts, self._sources, strict=True):
                host.copy_(tensor, non_blocking=True)
            self.done.record()
        staged = iter(hosts)
        self.buckets: list[Bucket] = [
            (path, key, (items, [(i, next(staged) if t.is_cuda else t) for i, t in tensors]))
            for path, key, (items, tensors) in buckets
        ]

    def finished(self) -> bool:
        return self.done.query()

    def wait(self) -> None:
        self.done.synchronize()

    def seconds(self) -> float:
        """How long the copy to host memory took on the device (once finished)."""
        return self._started.elapsed_time(self.done) / 1000

    def release(self) -> None:
        self._sources = []


def wait_before_updates(optimizers: Sequence[torch.optim.Optimizer], done: object) -> list:
    """Make each optimizer's update wait on the device for `done`; returns the hook handles."""

    def hook(*_: object) -> None:
        torch.cuda.current_stream().wait_event(done)

    return [opt.register_step_pre_hook(hook) for opt in optimizers]


class PendingSave:
    """An asynchronous save on its way: staged, written by a forked process, then finalized
    and published by `poll` or `wait` on every rank at the same step (both collective)."""

    def __init__(
        self,
        step: int,
        write: Callable[..., None] | None,
        args: list,
        staging: Staging | None,
        hooks: list,
        finalize: Callable[[], Path],
        phases: object,
    ) -> None:
        self.step = step
        self._write = write
        self._args = args
        self._staging = staging
        self._hooks = hooks
        self._finalize = finalize
        self._process: mp.Process | None = None
        self.phases = phases
        #: Seconds the device took to copy this rank's tensors to host memory (0: none).
        self.copy_seconds = 0.0
        if staging is None:
            self._fork()

    def poll(self) -> Path | None:
        """Fork the writer once the copy is done; publish if every rank's writer finished
        (one all-reduce); None while any rank copies or writes."""
        if self._staging is not None and self._staging.finished():
            self._fork()
        if not _all_ranks_done(self._staging is not None or self._writing()):
            return None
        return self._finish()

    def wait(self) -> Path:
        """Wait for the copy and every rank's writer, then publish."""
        if self._staging is not None:
            self._staging.wait()
            self._fork()
        if self._process is not None:
            self._process.join()
        _all_ranks_done(False)
        return self._finish()

    def _writing(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _fork(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            self.phases.mark("copy")
            for handle in self._hooks:
                handle.remove()
            self.copy_seconds = staging.seconds()
            self._args[1] = staging.buckets
            staging.release()
        if self._write is not None:
            self._process = mp.get_context("fork").Process(
                target=_writer, args=(os.getpid(), self._write, *self._args)
            )
            self._process.start()
        self.phases.mark("fork")

    def _finish(self) -> Path:
        if self._process is not None:
            self._process.join()
            self._process = None
        self.phases.mark("write")
        return self._finalize()


def _all_ranks_done(busy: bool) -> bool:
    flag = torch.tensor([int(busy)], dtype=torch.int32, device=collective_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() == 0


def _writer(parent: int, write: Callable[..., None], *args: object) -> None:
    """The forked writer of an async save: it dies with its rank (PR_SET_PDEATHSIG), so a rank
    killed mid-save leaves no process behind that could still write into a later attempt's
    temp dir of the same step."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the rank died before the prctl
        os._exit(1)
    write(*args)


_PR_SET_PDEATHSIG = 1
