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
