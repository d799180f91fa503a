"""The in-memory checkpoint tier with real Megatron-Core ranks (TP 1 × PP 2 × DP 2, the
distributed optimizer, gloo): a restarted rank loads from the slots its node task keeps, and
trains on bit for bit as the uninterrupted run did; one rank without a tier sends every rank
to disk."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from train_helpers import spec_dict

from contracts.restart import MEMORY_TIER_SLOTS

RANKS = 4


@pytest.fixture
def tiers() -> Iterator[list[tuple[int, ...]]]:
    """What a node task holds for its ranks: open memfds that outlive each run."""
    opened = [
        tuple(os.memfd_create(f"test-tier-{r}-{i}") for i in range(MEMORY_TIER_SLOTS))
        for r in range(RANKS)
    ]
    yield opened
    for fds in opened:
        for fd in fds:
            os.close(fd)


def _loaded(run) -> list[str]:
    """Where the checkpoint came from (rank 0 logs it; the ranks agreed on it)."""
    return [e["source"] for e in run.events(0) if e["event"] == "checkpoint_loaded"]


def test_a_restart_loads_from_memory_and_trains_on_exactly(run_train, tmp_path, tiers) -> None:
    spec = spec_dict("memory_tier", tp=1, pp=2, dp=2, steps=6, interval=3, layers=2)
    full = run_train(spec, tmp_path / "ck", memory_tiers=tiers)
    assert full.wait(240) == [0] * RANKS
    saved = [e["in_memory"] for e in full.events(0) if e["event"] == "checkpoint_saved"]
    assert saved == [True, True]  # on CPU every save is copied at once
    resumed = run_train(spec, tmp_path / "ck", ["--resume-step", "3"], memory_tiers=tiers)
    assert resumed.wait(240) == [0] * RANKS
    assert _loaded(resumed) == ["memory"]
    ref, got = full.losses(), resumed.losses()
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in got] == [ref[s] for s in got]

    # rank 0 has no tier (its node lost it, or a spare took its place): every rank takes part
    # in the agreement all the same, and every rank reads the disk
    mixed = [(), *tiers[1:]]
    from_disk = run_train(spec, tmp_path / "ck", ["--resume-step", "3"], memory_tiers=mixed)
    assert from_disk.wait(240) == [0] * RANKS
    assert _loaded(from_disk) == ["disk"]
    assert [from_disk.losses()[s] for s in got] == [ref[s] for s in got]
