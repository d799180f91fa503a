"""TP2×PP2 computes the same model as TP1×PP1 (Llama options: RMSNorm, SwiGLU, RoPE, GQA)."""

from __future__ import annotations

import pytest
from train_helpers import spec_dict

pytestmark = pytest.mark.timeout(400)


def _llama(name: str, tp: int, pp: int) -> dict:
    spec = spec_dict(name, tp=tp, pp=pp, dp=1, steps=3, interval=100)
    spec["model"].update(
        normalization="RMSNorm", activation="swiglu", position_embedding="rope", num_query_groups=2
    )
    return spec


def test_tp2_pp2_matches_tp1_from_layout_independent_init(run_train, tmp_path) -> None:
    big = run_train(_llama("llama-tp2pp2", 2, 2), tmp_path / "a")
    assert big.wait(300) == [0, 0, 0, 0]
    one = run_train(_llama("llama-tp1", 1, 1), tmp_path / "b")
    assert one.wait(300) == [0]
    a, b = big.losses(), one.losses()
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert [a[s] for s in a] == pytest.approx([b[s] for s in a], abs=1e-5)
    assert a[3] < a[1]


def _gpt(name: str, tp: int, **training: str) -> dict:
    spec = spec_dict(name, tp=tp, pp=1, dp=1, steps=3, interval=100)
    spec["parallelism"]["sequence_parallel"] = tp > 1
    spec["training"].update(training)
    return spec


def test_sequence_parallel_and_recompute_compute_the_same_model(run_train, tmp_path) -> None:
    """TP2 with sequence parallelism, and full / selective recomputation, train exactly as
    the plain layout does (the norms' weight gradients summed over the TP group)."""
    plain = run_train(_gpt("plain", 1), tmp_path / "plain")
    assert plain.wait(300) == [0]
    reference = plain.losses()
    assert sorted(reference) == [1, 2, 3]
    for name, spec in (
        ("sp", _gpt("sp", 2)),
        ("full", _gpt("full", 1, recompute="full")),
        ("selective", _gpt("selective", 2, recompute="selective")),
    ):
        run = run_train(spec, tmp_path / name)
        assert run.wait(300) == [0] * spec["resources"]["gpus_per_node"], name
        got = run.losses()
        assert [got[s] for s in (1, 2, 3)] == pytest.approx(
            [reference[s] for s in (1, 2, 3)], abs=1e-5
        ), name
