"""The in-memory checkpoint tier: each rank's state at its newest save, in host memory that its
node task holds, so that a restart inside the allocation loads from RAM instead of from disk.

A restart inside the job (`contracts.restart`) still read the checkpoint back from the shared
file system: 6.7 s of the 15.05 s from a crash to the first step (1.3B, DP 2, 2 × H200). Here
each save also copies the rank's local state (its model's parameters and buffers, its
optimizer's parameters and state, as the rank holds them) into a slot: a memfd that the node
task created before it forked the rank and keeps open, so the bytes outlive a rank that crashed.
A rank of the next attempt in the same place finds the slot of the checkpoint it resumes from
and copies it back: bit for bit what the checkpoint holds, both being taken from the same state
at the same step. Disk stays the durable tier: the slots are used only when every rank holds
the chosen checkpoint (its step, samples and loss, the rank's place, the same tensors);
otherwise every rank loads from disk, as a spare that took a node's place must.

Two slots per rank: the one the rank resumed from or captured last is kept while the other is
written (invalidated first, committed once the copy is complete), so a rank that dies mid-copy
leaves the capture before it. On GPU the copy runs on a side stream into page-locked slots
beside training, the optimizer's update waiting for it on the device (as `async_save` stages a
save); the slots are page-locked on a thread at a process's first save, which is therefore not
captured. Host memory: the slots hold twice the rank's state.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from contracts.restart import memory_tier_fds
from megatron_runs import async_save, dist_ckpt

logger = logging.getLogger(__name__)

#: A slot's first bytes: where its data starts (0: the slot holds nothing), its header's length.
_COMMIT = struct.Struct("<QQ")
#: Room for the header beyond its tensor table (the identity, the sequence number).
_HEADER_SLACK = 4096

Named = Sequence[tuple[str, torch.Tensor]]


def state_tensors(model: list, optimizer: object) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint restores on this rank, as the rank holds it, in a fixed order: every
    model chunk's parameters and buffers, then each inner optimizer's parameters (the main
    parameters of a distributed optimizer) each followed by its state. A tensor met twice
    (an optimizer that updates the model's own parameters) is listed once. The rest of an
    optimizer's param groups (learning rate, betas, ...) is the spec's, set anew by the loop.
    """
    seen: set[int] = set()
    named: list[tuple[str, torch.Tensor]] = []

    def add(name: str, value: object) -> None:
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            named.append((name, value))

    for i, chunk in enumerate(model):
        for key, value in dist_ckpt.unwrap(chunk).state_dict(keep_vars=True).items():
            add(f"model{i}.{key}", value)
    for j, inner in enumerate(dist_ckpt.inner_optimizers(optimizer)):
        if not isinstance(inner, torch.optim.Adam) and any("step" in g for g in inner.param_groups):
            # apex's and TE's fused Adam count steps there, which a slot does not hold (torch's
            # Adam counts them per parameter; megatron only carries them through its groups)
            raise ValueError(f"{type(inner).__name__} keeps its step in its param groups")
        for g, group in enumerate(inner.param_groups):
            for k, param in enumerate(group["params"]):
                add(f"optimizer{j}.{g}.{k}", param)
                state = inner.state.get(param, {})
                for key in sorted(state):
                    add(f"optimizer{j}.{g}.{k}.{key}", state[key])
    return named


@dataclass(frozen=True)
class Layout:
    """Where each tensor lies in a slot's data, and the chunks page-locked one call each (no
    tensor crosses a chunk, so every copy reads or writes one registered range)."""

    table: list[list]  # [name, shape, dtype, offset, bytes] per tensor
    chunks: list[tuple[int, int]]  # (offset, bytes)

    @property
    def nbytes(self) -> int:
        return self.chunks[-1][0] + self.chunks[-1][1] if self.chunks else 0


def layout(tensors: Named) -> Layout:
    offsets, chunks = async_save.chunked([t.numel() * t.element_size() for _, t in tensors])
    table = [
        [name, list(t.shape), str(t.dtype), offset, t.numel() * t.element_size()]
        for offset, (name, t) in zip(offsets, tensors, strict=True)
    ]
    return Layout(table, chunks)


class Slot:
    """One memfd: a commit record, the header (tensor table, identity, sequence number), then
    the data from a page boundary. Mapped once per process at its layout's size."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None
        self._flat: torch.Tensor | None = None
        self._layout: Layout | None = None
        self._data_at = 0
        self._pinned = False

    def header(self) -> dict | None:
        """The committed header, or None while the slot holds nothing whole."""
        raw = os.pread(self.fd, _COMMIT.size, 0)
        if len(raw) < _COMMIT.size:
            return None
        data_at, length = _COMMIT.unpack(raw)
        if not data_at:
            return None
        try:
            return json.loads(os.pread(self.fd, length, _COMMIT.size))
        except ValueError:
            return None

    def prepare(self, lay: Layout, pin: bool) -> None:
        """Map the slot for `lay` (sized anew, and so emptied, if its size differs), and
        page-lock its chunks when `pin`. A slot keeps its first mapping: a process's state
        keeps its layout."""
        if self._map is None:
            self._data_at = async_save.aligned(
                _COMMIT.size + len(json.dumps(lay.table)) + _HEADER_SLACK, mmap.PAGESIZE
            )
            size = self._data_at + lay.nbytes
            if os.fstat(self.fd).st_size != size:
                self.invalidate()
                _check_room(size)
                os.ftruncate(self.fd, size)
                os.posix_fallocate(self.fd, 0, size)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
            self._flat = torch.frombuffer(self._map, dtype=torch.uint8)
            self._layout = lay
        elif self._layout != lay:
            raise ValueError("the state's layout changed within the process")
        if pin and not self._pinned:
            cudart = torch.cuda.cudart()
            base = self._flat.data_ptr() + self._data_at
            done: list[int] = []
            for offset, n in lay.chunks:
                code = cudart.cudaHostRegister(base + offset, n, 0)
                if int(code) != 0:
                    for address in done:
                        cudart.cudaHostUnregister(address)
                    raise RuntimeError(f"cudaHostRegister of {n} bytes failed: {code}")
                done.append(base + offset)
            self._pinned = True

    def views(self) -> list[torch.Tensor]:
        """One host tensor per table entry, over the slot's data."""
        assert self._flat is not None and self._layout is not None
        out = []
        for _, shape, dtype, offset, n in self._layout.table:
            start = self._data_at + offset
            raw = self._flat[start : start + n]
            out.append(raw.view(getattr(torch, dtype.removeprefix("torch."))).view(shape))
        return out

    def invalidate(self) -> None:
        os.pwrite(self.fd, _COMMIT.pack(0, 0), 0)

    def commit(self, identity: dict, sequence: int) -> None:
        """Record what the slot now holds; the commit record is written last."""
        assert self._layout is not None
        body = json.dumps(
            {"table": self._layout.table, "identity": identity, "sequence": sequence}
        ).encode()
        if _COMMIT.size + len(body) > self._data_at:
            raise ValueError("a slot's header outgrew its room")
        os.pwrite(self.fd, body, _COMMIT.size)
        os.pwrite(self.fd, _COMMIT.pack(self._data_at, len(body)), 0)


#: Host memory a rank leaves free beside its slots, as a share of what is available.
ROOM_MARGIN = 0.25


def _check_room(nbytes: int) -> None:
    """Refuse a slot the host cannot hold with room to spare: a memfd lives on the kernel's
    unbounded shm mount, so an allocation past the memory left does not fail, it wakes the
    OOM killer (of the job's memory cgroup, under SLURM), which kills a rank. Every rank of
    the node makes its slots at about the same time: each may take its share of what is
    left."""
    ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    left = min(_mem_available(), _cgroup_headroom())
    if nbytes * ranks > left * (1 - ROOM_MARGIN):
        raise OSError(errno.ENOMEM, f"no room for a {nbytes} byte memory tier slot")


def _mem_available() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return float("inf")


def _cgroup_headroom() -> float:
    """memory.max − memory.current of this process's cgroup (v2); infinite without a limit."""
    try:
        with open("/proc/self/cgroup") as fh:
            path = next(line.split(":", 2)[2].strip() for line in fh if line.startswith("0::"))
        folder = Path("/sys/fs/cgroup") / path.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return float("inf")
        return int(limit) - int((folder / "memory.current").read_text())
    except (OSError, StopIteration, ValueError):
        return float("inf")


def identity(step: int, consumed_samples: int, loss: float | None, rank: int, world: int) -> dict:
    """What names a checkpoint and the rank's place in it; the loss as the checkpoint's
    metadata records it (NaN: none)."""
    return {
        "step": step,
        "consumed_samples": consumed_samples,
        "loss": loss if loss is None or loss == loss else None,
        "rank": rank,
        "world": world,
    }


class MemoryTier:
    """A rank's slots: `capture` at each save, `load` at a resume that finds its checkpoint."""

    def __init__(self, fds: Sequence[int]) -> None:
        self.slots = [Slot(fd) for fd in fds]
        self.cuda = torch.cuda.is_available()
        headers = [slot.header() for slot in self.slots]
        held = [(h["sequence"], i) for i, h in enumerate(headers) if h is not None]
        #: The slot the rank resumed from or captured last: never the next one written.
        self._keep = max(held)[1] if held else None
        self._sequence = max(held)[0] + 1 if held else 0
        self._stream: torch.cuda.Stream | None = None
        self._inflight: tuple[int, dict, object, list, Named] | None = None
        self._pinning: threading.Thread | None = None
        self._pinned_for: Layout | None = None
        self._error: BaseException | None = None

    @classmethod
    def from_env(cls) -> MemoryTier | None:
        """The tier this rank's node task handed it (`contracts.restart.MEMORY_TIER_ENV`)."""
        fds = memory_tier_fds(os.environ)
        if not fds:
            return None
        try:
            return cls(fds)
        except OSError as exc:  # descriptors that are not open: no tier, disk as before
            logger.warning("memory tier descriptors %s unusable: %r", fds, exc)
            return None

    def open(self, ident: dict, tensors: Named) -> int | None:
        """The slot holding the checkpoint `ident` names, for exactly these tensors, mapped
        (and on GPU page-locked) for `load`; None if no slot holds it or it cannot be mapped.
        Either way a slot that holds it is kept from the next capture."""
        lay = layout(tensors)
        table = json.loads(json.dumps(lay.table))
        held = [
            (header["sequence"], i)
            for i, header in enumerate(slot.header() for slot in self.slots)
            if header is not None and header["identity"] == ident and header["table"] == table
        ]
        if not held:
            return None
        index = max(held)[1]
        self._keep = index
        try:
            self.slots[index].prepare(lay, pin=self.cuda)
        except (OSError, RuntimeError) as exc:
            logger.warning("memory tier slot %d cannot be mapped: %r", index, exc)
            return None
        return index

    @torch.no_grad()
    def load(self, index: int, tensors: Named) -> None:
        """Copy slot `index` (`open`ed) into the rank's tensors; then (GPU) page-lock the
        other slots on a thread, for this process's saves."""
        for view, (_, tensor) in zip(self.slots[index].views(), tensors, strict=True):
            tensor.copy_(view, non_blocking=True)
        if self.cuda:
            torch.cuda.synchronize()
            self._pin_on_thread(layout(tensors))
        self._keep = index

    def capture(self, tensors: Named, ident: dict, optimizers: Sequence[object]) -> bool:
        """Start copying the rank's state into the slot not kept; False when the slots are
        not ready yet (GPU: being page-locked)."""
        self.finish()
        self._forget(ident)
        lay = layout(tensors)
        if self.cuda and not self._pinned(lay):
            return False
        index = next(i for i in range(len(self.slots)) if i != self._keep)
        slot = self.slots[index]
        slot.prepare(lay, pin=self.cuda)
        slot.invalidate()
        views = slot.views()
        if not self.cuda:
            with torch.no_grad():
                for view, (_, tensor) in zip(views, tensors, strict=True):
                    view.copy_(tensor)
            self._commit(index, ident)
            return True
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        copied = torch.cuda.Event()
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for view, (_, tensor) in zip(views, tensors, strict=True):
                view.copy_(tensor, non_blocking=True)
            copied.record()
        hooks = async_save.wait_before_updates(optimizers, copied)
        self._inflight = (index, ident, copied, hooks, tensors)  # the sources live till copied
        return True

    def poll(self) -> None:
        """Commit the capture in flight once its copy is done (no collective)."""
        if self._inflight is not None and self._inflight[2].query():
            self._commit(*self._inflight[:2])

    def finish(self) -> None:
        """Wait for the capture in flight and commit it."""
        if self._inflight is not None:
            self._inflight[2].synchronize()
            self._commit(*self._inflight[:2])

    def drop(self) -> None:
        """Empty every slot (best effort): a tier that stops capturing must not keep an older
        capture of a step that a later save wrote to disk anew."""
        for slot in self.slots:
            try:
                slot.invalidate()
            except OSError:
                continue

    def _forget(self, ident: dict) -> None:
        """Empty the slots holding an earlier capture of the checkpoint about to be saved (a
        rollback saves a step again, not necessarily with the same bytes)."""
        for slot in self.slots:
            header = slot.header()
            if header is not None and header["identity"] == ident:
                slot.invalidate()

    def _commit(self, index: int, ident: dict) -> None:
        if self._inflight is not None:
            for handle in self._inflight[3]:
                handle.remove()
            self._inflight = None
        self.slots[index].commit(ident, self._sequence)
        self._sequence += 1
        self._keep = index

    def _pinned(self, lay: Layout) -> bool:
        """The slots are page-locked for `lay`; if not, that starts on a thread."""
        if self._pinning is not None:
            if self._pinning.is_alive():
                return False
            self._pinning = None
        if self._error is not None:
            raise RuntimeError("page-locking the memory tier failed") from self._error
        if self._pinned_for == lay:
            return True
        self._pin_on_thread(lay)
        return False

    def _pin_on_thread(self, lay: Layout) -> None:
        def pin() -> None:
            try:
                for slot in self.slots:
                    slot.prepare(lay, pin=True)
                self._pinned_for = lay
            except BaseException as exc:  # surfaces in the training thread (`_pinned`)
                self._error = exc

        self._pinning = threading.Thread(target=pin, name="nightwatch-memory-tier", daemon=True)
        self._pinning.start()
