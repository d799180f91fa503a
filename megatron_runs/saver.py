"""The training loop's checkpoints: when a save starts, when it is published, what is reported.

`checkpoint.async_save: false` saves at the step boundary and trains on once the checkpoint is
published. With `true`, the loop stalls only while the save is planned; the state is copied to
host memory while the next steps run (`async_save`), every later step polls the save (one
all-reduce), the first poll after the copy forks the writers, and the step at which every
rank's writer has finished publishes it. A second save, the end of training and a stop
signal first wait for the save in flight and publish it, so the exit code's promise (a
checkpoint at the step the job stopped) holds either way.

With a memory tier (`memory_tier`), each save that started also copies the rank's state into
it; the copy is committed by a later step's poll (GPU) or at once (CPU). A tier that fails is
reported and dropped: disk stays the durable tier.

A storage failure is reported and training goes on (the next interval retries). A failed
collective is not caught: a peer died mid-save, and ranks that go on from wherever their save
broke off meet in different collectives and hang (tests/train/test_save_failures.py), which
reads as a hang of a healthy node. Raised, every rank exits and the job fails at once: a
crash, which the watchdog restarts. A save in flight when that happens is never published.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from contracts.checkpoints import SaveTiming, write_save_timing, young_daly_steps
from contracts.spec import CheckpointSpec
from megatron_runs import async_save, dist_ckpt, memory_tier
from megatron_runs.faults import Faults
from megatron_runs.metrics import TrainMetrics


class Checkpointer:
    """Saves of one attempt. Retention spares the checkpoint this attempt resumed from: the
    watchdog may be rolling back to it while this attempt, going bad, saves on."""

    def __init__(
        self,
        spec: CheckpointSpec,
        root: Path,
        layout: dict[str, int],
        resumed_from: int | None,
        metrics: TrainMetrics | None,
        faults: Faults,
        log: Callable[..., None],
        mtbf_seconds: float | None = None,
        tier: memory_tier.MemoryTier | None = None,
    ) -> None:
        self.spec = spec
        self.mtbf_seconds = mtbf_seconds or spec.mtbf_hours * 3600
        #: Steps between saves; with `interval_auto`, rank 0 proposes a new one after each
        #: save (`proposed`) and the loop adopts it once the step's all-reduce carried it.
        self.interval = spec.interval_steps
        self.proposed = 0
        self.root = root
        self.layout = layout
        self.protect = frozenset({resumed_from} if resumed_from else set())
        self.metrics = metrics
        self.faults = faults
        self.log = log
        self.writer = dist_ckpt.Writer()
        self.pending: async_save.PendingSave | None = None
        self.started = 0.0  # when the save in flight began
        self.step_seconds = 0.0  # the wall time of the step before the save in flight
        self.last_seconds = 0.0  # how long the newest published save took, start to publish
        #: The step of the newest checkpoint there is or will be once the save in flight is
        #: published (the one resumed from, before any save).
        self.newest_step = resumed_from or 0
        self.stall = 0.0  # how long the loop has waited for it so far
        self.tier = tier
        self.captured_step: int | None = None  # the newest save copied into the tier

    def save(
        self,
        model: list,
        optimizer: object,
        step: int,
        cursor: int,
        loss: float,
        loss_trend: tuple[float, ...] = (),
        step_seconds: float = 0.0,
        last_eval: tuple[int, float] | None = None,
    ) -> None:
        """Save at `step` (collective); with async saves, start it and return. `step_seconds`:
        the wall time of the step before it, recorded with the save's own timing."""
        with self._waiting():
            self._finish()
            self.step_seconds = step_seconds
            target = dist_ckpt.Target(
                self.root, step, cursor, loss, self.layout, self.spec.keep_last, self.protect,
                self.spec.keep_seconds, loss_trend, last_eval,
            )  # fmt: skip
            t0 = self.started = time.perf_counter()
            try:
                if self.spec.async_save:
                    self.pending = self.writer.start(model, optimizer, target)
                    self.newest_step = step
                    self._capture(model, optimizer, target)
                    self.stall = time.perf_counter() - t0
                    return
                path = self.writer.save(model, optimizer, target)
            except dist_ckpt.STORAGE_ERRORS as exc:
                self._failed(step, time.perf_counter() - t0, exc)
                return
            self.newest_step = step
            self._capture(model, optimizer, target)
            duration = time.perf_counter() - t0
            self._published(step, path, duration, duration)

    def poll(self) -> None:
        """Publish the save in flight if every rank's writer finished (collective, each step)."""
        if self.pending is not None:
            self._settle(self.pending.poll)
        if self.tier is not None:
            self._guard(self.tier.poll)

    def finish(self) -> None:
        """Wait for the save in flight and publish it (collective)."""
        with self._waiting():
            self._finish()

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Export that the loop waits on a save while it does (`save_started_timestamp_
        seconds`): the watchdog judges a stall in a save by the save's limit, not a step's."""
        if self.metrics is not None:
            self.metrics.on_save_wait(True)
        try:
            yield
        finally:
            if self.metrics is not None:
                self.metrics.on_save_wait(False)

    def _finish(self) -> None:
        if self.pending is not None:
            self._settle(self.pending.wait)
        if self.tier is not None:
            self._guard(self.tier.finish)

    def _capture(self, model: list, optimizer: object, target: dist_ckpt.Target) -> None:
        """Copy the state just saved into the memory tier (not collective)."""
        tier = self.tier
        if tier is None:
            return
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        ident = memory_tier.identity(target.step, target.consumed_samples, target.loss, rank, world)

        def capture() -> bool:
            tensors = memory_tier.state_tensors(model, optimizer)
            return tier.capture(tensors, ident, dist_ckpt.inner_optimizers(optimizer))

        if self._guard(capture):
            self.captured_step = target.step

    def _guard(self, action: Callable[[], object]) -> object:
        """Run a memory tier action; a failure drops the tier (the disk has every save)."""
        try:
            return action()
        except (OSError, RuntimeError, ValueError) as exc:
            tier, self.tier = self.tier, None
            if tier is not None:
                tier.drop()
            self.log("memory_tier_failed", error=repr(exc))
            return None

    def _settle(self, publish: Callable[[], Path | None]) -> None:
        pending = self.pending
        assert pending is not None
        t0 = time.perf_counter()
        try:
            path = publish()
        except dist_ckpt.STORAGE_ERRORS as exc:
            self.pending = None
            self._failed(pending.step, time.perf_counter() - self.started, exc)
            return
        if path is None:
            return
        self.pending = None
        self.stall += time.perf_counter() - t0
        self._published(pending.step, path, time.perf_counter() - self.started, self.stall)

    def _failed(self, step: int, duration: float, exc: Exception) -> None:
        if self.metrics is not None:
            self.metrics.on_checkpoint(step, duration, ok=False)
        self.log("checkpoint_failed", all_ranks=True, step=step, error=repr(exc))

    def _published(self, step: int, path: Path, duration: float, stall: float) -> None:
        """`duration`: from the save's start until published; `stall`: how long the loop
        waited for it (the same for a synchronous save)."""
        self.last_seconds = duration
        if self.metrics is not None:
            self.metrics.on_checkpoint(step, duration, ok=True)
        self.log(
            "checkpoint_saved", step=step, path=str(path), seconds=round(duration, 3),
            stall_seconds=round(stall, 3), async_save=self.spec.async_save,
            in_memory=self.captured_step == step,
        )  # fmt: skip
        if torch.distributed.get_rank() == 0:
            if self.spec.interval_auto:
                self.proposed = young_daly_steps(
                    stall, self.mtbf_seconds, self.step_seconds,
                    self.spec.interval_min_steps, self.spec.interval_max_steps,
                )  # fmt: skip
            timing = SaveTiming(
                step, duration, stall, self.step_seconds, self.spec.async_save,
                self.proposed or self.interval,
            )  # fmt: skip
            try:
                write_save_timing(self.root, timing)
            except OSError as exc:  # the supervisor falls back to its default lead
                self.log("save_timing_failed", error=repr(exc))
            victim = self.faults.corrupt_after_publish(step, path)
            if victim is not None:
                self.log("injected_checkpoint_corruption", step=step, file=str(victim))
