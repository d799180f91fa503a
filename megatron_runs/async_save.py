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

A process's first save has no buffers yet. Pinning them at once (`cudaHostAlloc`) held the
loop 11–13 s for 17 GiB on the H200 machine, and pinning them that way on a thread made the
steps meanwhile 8.6 s slower in all (it holds the CUDA driver's lock). So the first save
clones the state on the device (its only wait; it needs that much free device memory, else
the old way) and a thread faults in pageable memory, page-locks it in chunks
(`HostBuffers.register`), and copies the clone into it (figures in docs/benchmarks.md).

With `overlap_param_gather` (DP > 1) the next forward pass may all-gather the parameters again
while the copy reads them: the gather writes the bytes they already hold (no update came in
between, `finish_param_gather` ran before the save), so the copy reads the same values.

Publishing is unchanged: only after every rank's writer finished, megatron's finalize wrote the
metadata and rank 0 made it durable (`publish`). A rank that dies before that leaves a temp dir
that never looks complete.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import multiprocessing as mp

from megatron_runs.cpu_compat import collective_device

#: megatron's write buckets: (file path, storage key, (bytes items, tensor items)).
Bucket = tuple[str, str, tuple[list, list]]


class HostBuffers:
    """Host tensors a rank's saves copy into, kept between saves, and page-locked so the copy
    runs beside training. Reused while the tensors' shapes and dtypes stay the same.

    How they are made decides the first save's stall (`benchmarks/host_copy_gpu.py`, 17 GiB
    on an H200): `cudaHostAlloc` (torch's `pin_memory=True`) held the loop 8-10 s, because it
    allocates and zeroes every page while it holds the CUDA driver's lock; page-locking memory
    whose pages exist already (`cudaHostRegister`) took 0.7-0.9 s. So `register` first faults
    in shared anonymous memory (kernel work that takes no CUDA lock), then registers it in
    chunks of at most `CHUNK_BYTES`, each tensor inside one chunk, so no single call holds the
    lock long.
    """

    #: The most bytes one `cudaHostRegister` call page-locks.
    CHUNK_BYTES = 1 << 30
    #: Where each tensor starts within its chunk (a multiple of every element size).
    ALIGN = 512

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._tensors: list[torch.Tensor] = []
        self._registered: list[int] = []  # the page-locked chunks' addresses
        self._region: torch.Tensor | None = None

    def reuse(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The buffers of an earlier save of the same layout, else None."""
        if self._tensors and _layout(self._tensors) == _layout(tensors):
            return self._tensors
        return None

    def like(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One buffer per tensor, in order; allocated anew (pinned at once) if the layout
        changed."""
        if self.reuse(tensors) is None:
            self._free()
            self._tensors = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin) for t in tensors
            ]
        return self._tensors

    def register(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One page-locked buffer per tensor, in order, made the cheap way (class docstring);
        runs on a thread beside training."""
        self._free()
        offsets, chunks = chunked([t.numel() * t.element_size() for t in tensors])
        size = chunks[-1][0] + chunks[-1][1] if chunks else 0
        # Shared, not private: a private page that is page-locked is copied when the rank
        # forks its writer (17 GiB: 5-8 s in the poll that forks), a shared one is not.
        region = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        flat = torch.frombuffer(region, dtype=torch.uint8)
        flat[:: mmap.PAGESIZE].zero_()  # fault every page in: no CUDA lock held
        self._region = flat
        cudart = torch.cuda.cudart()
        for start, n in chunks:
            code = cudart.cudaHostRegister(flat.data_ptr() + start, n, 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister of {n} bytes failed: {code}")
            self._registered.append(flat.data_ptr() + start)
        base = flat.data_ptr()
        self._tensors = [_tensor_at(base + at, t) for at, t in zip(offsets, tensors, strict=True)]
        return self._tensors

    def _free(self) -> None:
        self._tensors = []
        cudart = torch.cuda.cudart() if self._registered else None
        for address in self._registered:
            cudart.cudaHostUnregister(address)
        self._registered = []
        self._region = None


def chunked(sizes: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Where tensors of these byte sizes lie in one host region (each at a multiple of
    `HostBuffers.ALIGN`), and the chunks that are page-locked one call each: page-aligned, at
    most `HostBuffers.CHUNK_BYTES` unless one tensor is larger, and no tensor crosses one, so
    every copy reads or writes one registered range."""
    offsets: list[int] = []
    chunks: list[tuple[int, int]] = []
    start = used = 0
    for n in sizes:
        need = aligned(n, HostBuffers.ALIGN)
        if used and used + need > HostBuffers.CHUNK_BYTES:
            chunks.append((start, used))
            start, used = aligned(start + used, mmap.PAGESIZE), 0
        offsets.append(start + used)
        used += need
    if used:
        chunks.append((start, used))
    return offsets, chunks


def _tensor_at(address: int, like: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped like `like` over the bytes at `address`, with a storage of its own
    size: megatron's writer saves each tensor's whole storage, so a slice of a shared chunk
    would write the chunk (and fail its size check). The chunk must outlive it."""
    n = like.numel() * like.element_size()
    if n == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    raw = (ctypes.c_char * n).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(like.dtype).view(like.shape)


def aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def _layout(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype]]:
    return [(t.shape, t.dtype) for t in tensors]


def _fits_on_device(tensors: Sequence[torch.Tensor], margin: float = 1.1) -> bool:
    """Room on the device for a clone of `tensors` (with a margin)."""
    need = sum(t.numel() * t.element_size() for t in tensors)
    free, _total = torch.cuda.mem_get_info()
    return need * margin + (256 << 20) < free


class Staging:
    """The device tensors of a save on their way to host buffers, on a side stream; the
    optimizer's update waits on the device for `captured` (the state as of the save).

    With buffers of an earlier save the copy goes straight into them. A process's first save
    has none: it clones the tensors on the device (a device-to-device copy: the only wait) and
    a thread makes the buffers (`HostBuffers.register`) and copies the clone into them, so
    training goes on meanwhile; without room on the device for the clone, the buffers are
    pinned at once and the loop waits for that."""

    def __init__(self, buckets: list[Bucket], buffers: HostBuffers, stream: object) -> None:
        # what the copy reads, kept until it is done
        self._sources = [t for _, _, (_, tensors) in buckets for _, t in tensors if t.is_cuda]
        self._stream = stream
        self._copy_seconds: list[tuple[object, object]] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.done = torch.cuda.Event()
        stream.wait_stream(torch.cuda.current_stream())
        hosts = buffers.reuse(self._sources)
        if hosts is None and buffers.pin and _fits_on_device(self._sources):
            with torch.cuda.stream(stream):
                started = torch.cuda.Event(enable_timing=True)
                started.record()
                self._sources = [t.clone() for t in self._sources]
                self.captured = torch.cuda.Event(enable_timing=True)
                self.captured.record()
            self._copy_seconds.append((started, self.captured))
            hosts = [torch.empty(0)] * len(self._sources)  # filled in by the thread
            self._thread = threading.Thread(
                target=self._register_and_copy, args=(buffers, hosts), daemon=True
            )
            self._thread.start()
        else:
            hosts = hosts if hosts is not None else buffers.like(self._sources)
            self._copy(hosts)
            self.captured = self.done
        self._hosts = hosts
        self._buckets = buckets

    def _copy(self, hosts: list[torch.Tensor]) -> None:
        with torch.cuda.stream(self._stream):
            started = torch.cuda.Event(enable_timing=True)
            started.record()
            for host, tensor in zip(hosts, self._sources, strict=True):
                host.copy_(tensor, non_blocking=True)
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self.done.record()
        self._copy_seconds.append((started, ended))

    def _register_and_copy(self, buffers: HostBuffers, hosts: list[torch.Tensor]) -> None:
        try:
            hosts[:] = buffers.register(self._sources)
            self._copy(hosts)
        except BaseException as exc:  # surfaces in the training thread (`finished`, `wait`)
            self._error = exc

    def _joined(self) -> bool:
        """The thread (if any) has ended; its failure is raised here."""
        if self._thread is not None:
            if self._thread.is_alive():
                return False
            self._thread = None
        if self._error is not None:
            raise RuntimeError("staging the save to host memory failed") from self._error
        return True

    @property
    def buckets(self) -> list[Bucket]:
        """megatron's write buckets with the host buffers in place of the device tensors
        (once finished)."""
        staged = iter(self._hosts)
        return [
            (path, key, (items, [(i, next(staged) if t.is_cuda else t) for i, t in tensors]))
            for path, key, (items, tensors) in self._buckets
        ]

    def finished(self) -> bool:
        return self._joined() and self.done.query()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self._joined()
        self.done.synchronize()

    def seconds(self) -> float:
        """How long the device spent copying this save's state (clone and copy to host
        memory), once finished."""
        return sum(a.elapsed_time(b) for a, b in self._copy_seconds) / 1000

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
