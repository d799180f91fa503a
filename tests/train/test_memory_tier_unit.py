"""The in-memory checkpoint tier's slots, in one process (no ranks): what a capture commits,
what a fresh tier (a restarted rank) finds and loads, which slot the next capture overwrites."""

from __future__ import annotations

import os
import types
from collections.abc import Iterator

import pytest
import torch

from contracts.restart import MEMORY_TIER_SLOTS
from megatron_runs.cpu_compat import stub_triton_kernels

stub_triton_kernels()

from megatron_runs import memory_tier  # noqa: E402
from megatron_runs.memory_tier import MemoryTier  # noqa: E402


@pytest.fixture
def fds() -> Iterator[tuple[int, ...]]:
    opened = tuple(os.memfd_create(f"test-slot-{i}") for i in range(MEMORY_TIER_SLOTS))
    yield opened
    for fd in opened:
        os.close(fd)


def _state(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("w", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("step", torch.tensor(float(seed))),
        ("empty", torch.empty(0, 4)),
    ]


def _ident(step: int) -> dict:
    return memory_tier.identity(step, 8 * step, 2.5, rank=0, world=1)


def _loaded(fds: tuple[int, ...], step: int, like: list) -> list[torch.Tensor] | None:
    """What a restarted rank would load for `step` (a fresh tier over the same slots)."""
    tier = MemoryTier(fds)
    target = [(name, torch.zeros_like(t)) for name, t in like]
    slot = tier.open(_ident(step), target)
    if slot is None:
        return None
    tier.load(slot, target)
    return [t for _, t in target]


def test_a_capture_is_found_and_loaded_bit_for_bit_by_a_fresh_tier(fds) -> None:
    state = _state(1)
    assert MemoryTier(fds).capture(state, _ident(10), optimizers=[])
    got = _loaded(fds, 10, state)
    assert got is not None
    for loaded, (_, original) in zip(got, state, strict=True):
        assert loaded.dtype == original.dtype and torch.equal(loaded, original)


def test_only_the_named_checkpoint_and_layout_are_found(fds) -> None:
    MemoryTier(fds).capture(_state(1), _ident(10), optimizers=[])
    assert _loaded(fds, 20, _state(1)) is None
    elsewhere = memory_tier.identity(10, 80, 2.5, rank=1, world=2)
    assert MemoryTier(fds).open(elsewhere, _state(1)) is None
    other_shapes = [("w", torch.zeros(5, 3)), *_state(1)[1:]]
    assert MemoryTier(fds).open(_ident(10), other_shapes) is None
    assert MemoryTier(fds).open(memory_tier.identity(10, 80, 2.6, 0, 1), _state(1)) is None


def test_two_slots_keep_the_capture_before_the_newest(fds) -> None:
    tier = MemoryTier(fds)
    for step in (10, 20, 30):
        tier.capture(_state(step), _ident(step), optimizers=[])
    assert _loaded(fds, 10, _state(10)) is None  # overwritten by 30
    assert torch.equal(_loaded(fds, 20, _state(20))[0], _state(20)[0][1])  # type: ignore[index]
    assert torch.equal(_loaded(fds, 30, _state(30))[0], _state(30)[0][1])  # type: ignore[index]


def test_a_capture_cut_short_leaves_the_one_before(fds) -> None:
    """A rank that dies mid-copy: the slot was invalidated first and never committed."""
    tier = MemoryTier(fds)
    tier.capture(_state(10), _ident(10), optimizers=[])
    tier.capture(_state(20), _ident(20), optimizers=[])
    fresh = MemoryTier(fds)
    victim = fresh.open(_ident(10), _state(10))
    assert victim is not None
    fresh.slots[victim].invalidate()
    assert _loaded(fds, 10, _state(10)) is None
    assert _loaded(fds, 20, _state(20)) is not None


def test_the_slot_a_rank_resumed_from_is_kept_while_it_saves_on(fds) -> None:
    """Resumed from 10 (the older slot; 20 was captured but the run rolled back to 10), the
    next capture overwrites 20's slot and not the one resumed from."""
    tier = MemoryTier(fds)
    tier.capture(_state(10), _ident(10), optimizers=[])
    tier.capture(_state(20), _ident(20), optimizers=[])
    resumed = MemoryTier(fds)
    state = [(name, torch.zeros_like(t)) for name, t in _state(10)]
    slot = resumed.open(_ident(10), state)
    assert slot is not None
    resumed.load(slot, state)
    resumed.capture(_state(15), _ident(15), optimizers=[])
    assert _loaded(fds, 10, _state(10)) is not None
    assert _loaded(fds, 15, _state(15)) is not None
    assert _loaded(fds, 20, _state(20)) is None


def test_a_nan_loss_is_named_as_the_checkpoint_records_it() -> None:
    assert memory_tier.identity(5, 40, float("nan"), 0, 1)["loss"] is None


def test_a_step_saved_again_replaces_its_older_capture(fds) -> None:
    """A rollback saves step 10 again, not necessarily with the same bytes: the older
    capture of 10 is emptied first, so only the new one can be loaded."""
    first = MemoryTier(fds)
    first.capture(_state(1), _ident(10), optimizers=[])
    first.capture(_state(2), _ident(20), optimizers=[])
    again = MemoryTier(fds)
    again.capture(_state(3), _ident(10), optimizers=[])
    got = _loaded(fds, 10, _state(3))
    assert got is not None and torch.equal(got[0], _state(3)[0][1])
    assert _loaded(fds, 20, _state(2)) is not None


def test_a_dropped_tier_holds_nothing(fds) -> None:
    tier = MemoryTier(fds)
    tier.capture(_state(1), _ident(10), optimizers=[])
    tier.drop()
    assert _loaded(fds, 10, _state(1)) is None


def test_a_slot_the_host_cannot_hold_is_refused(fds, monkeypatch) -> None:
    monkeypatch.setattr(memory_tier, "_mem_available", lambda: 100.0)
    with pytest.raises(OSError, match="no room"):
        MemoryTier(fds).capture(_state(1), _ident(10), optimizers=[])


def test_an_optimizer_counting_steps_in_its_param_groups_is_refused() -> None:
    """apex's and TE's fused Adam keep `step` in the param group, which no slot holds."""
    param = torch.nn.Parameter(torch.zeros(2))
    inner = torch.optim.SGD([param], lr=0.1)
    inner.param_groups[0]["step"] = 3
    with pytest.raises(ValueError, match="param groups"):
        memory_tier.state_tensors([torch.nn.Linear(1, 1)], types.SimpleNamespace(optimizer=inner))
