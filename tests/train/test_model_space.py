"""The distributed optimizer's model-space format (megatron_runs.model_space): a DP slice cut
into rectangles covers exactly its elements, and a checkpoint resumes exactly onto another
TP × PP × DP layout, SwiGLU's split fc1 included."""

from __future__ import annotations

import math
import random

import pytest
import torch
from train_helpers import spec_dict

from megatron_runs.cpu_compat import stub_triton_kernels

stub_triton_kernels()

from megatron_runs.model_space import rectangles  # noqa: E402


def test_rectangles_cover_the_range_in_order() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        start = rng.randint(0, n)
        stop = rng.randint(start, n)
        flat = torch.arange(n)
        whole = flat.view(shape)
        seen: list[int] = []
        for offset, size, first in rectangles(shape, start, stop):
            block = whole[tuple(slice(o, o + k) for o, k in zip(offset, size, strict=True))]
            assert tuple(block.shape) == size
            assert block.reshape(-1).tolist() == list(range(first, first + math.prod(size)))
            seen += block.reshape(-1).tolist()
        assert seen == list(range(start, stop)), (shape, start, stop)
        assert len(rectangles(shape, start, stop)) <= 2 * len(shape) - 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("saved", "resumed"), [((2, 1, 2), (1, 2, 2)), ((1, 1, 4), (2, 1, 1))], ids=str
)
def test_swiglu_resume_onto_another_layout_is_exact(run_train, tmp_path, saved, resumed) -> None:
    def spec(layout: tuple[int, int, int]) -> dict:
        tp, pp, dp = layout
        out = spec_dict("model_space", tp=tp, pp=pp, dp=dp, steps=6, interval=3)
        out["model"]["activation"] = "swiglu"
        return out

    full = run_train(spec(saved), tmp_path / "ck")
    assert full.wait(240) == [0] * math.prod(saved)
    other = run_train(spec(resumed), tmp_path / "ck", ["--resume-step", "3"])
    assert other.wait(240) == [0] * math.prod(resumed)
    ref, got = full.losses(), other.losses()
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in got] == pytest.approx([ref[s] for s in got], abs=1e-4)
