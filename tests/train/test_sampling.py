"""Data order: pure functions of (seed, step, global batch) with skip ranges honoured."""

from __future__ import annotations

import pytest

from megatron_runs.sampling import dataset_index, normalize_skips, rank_slice, take_step


def _consume(steps: int, gb: int, skips: list[tuple[int, int]], cursor: int = 0) -> list[int]:
    out = []
    for _ in range(steps):
        taken = take_step(cursor, gb, skips)
        out.extend(taken.indices)
        cursor = taken.next_cursor
    return out


def test_without_skips_step_s_takes_its_own_block() -> None:
    assert take_step(5 * 8, 8, []).indices == tuple(range(40, 48))
    assert take_step(5 * 8, 8, []).next_cursor == 48


def test_skips_remove_exactly_the_skipped_samples() -> None:
    clean = _consume(10, 8, [])
    skipped = _consume(10, 8, [(12, 20), (33, 35)])
    expected = [g for g in range(200) if not (12 <= g < 20 or 33 <= g < 35)][:80]
    assert skipped == expected
    assert set(clean[:12]) <= set(skipped)


def test_resume_with_skips_matches_clean_run_with_same_skips() -> None:
    skips = [(40, 48)]
    full = _consume(8, 8, skips)
    first = take_step(0, 8, skips)
    cursor = first.next_cursor
    for _ in range(3):
        cursor = take_step(cursor, 8, skips).next_cursor
    resumed = _consume(4, 8, skips, cursor=cursor)
    assert full[32:] == resumed


def test_skipped_counter_counts_only_samples_stepped_over() -> None:
    assert take_step(40, 8, [(40, 48)]).skipped == 8
    assert take_step(32, 8, [(40, 48)]).skipped == 0
    assert take_step(44, 8, [(40, 48)]).skipped == 4


def test_normalize_merges_and_rejects_negative() -> None:
    assert normalize_skips([(5, 9), (0, 2), (8, 12), (3, 3)]) == [(0, 2), (5, 12)]
    with pytest.raises(ValueError):
        normalize_skips([(-1, 4)])


def test_rank_slice_depends_on_dp_rank_only() -> None:
    idx = list(range(16, 24))
    assert rank_slice(idx, 0, 2) == [16, 17, 18, 19]
    assert rank_slice(idx, 1, 2) == [20, 21, 22, 23]
    assert [g for r in range(4) for g in rank_slice(idx, r, 4)] == idx
    with pytest.raises(ValueError):
        rank_slice(idx, 0, 3)


def test_dataset_index_is_a_seeded_permutation_per_epoch() -> None:
    n = 50
    epoch0 = [dataset_index(g, n, seed=1) for g in range(n)]
    epoch1 = [dataset_index(g, n, seed=1) for g in range(n, 2 * n)]
    assert sorted(epoch0) == list(range(n)) == sorted(epoch1)
    assert epoch0 != epoch1
    assert epoch0 == [dataset_index(g, n, seed=1) for g in range(n)]
    assert epoch0 != [dataset_index(g, n, seed=2) for g in range(n)]
