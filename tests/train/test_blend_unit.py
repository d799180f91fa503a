"""megatron_runs.blend without a process group: what Megatron's builder gives for a blend and
a split, as the trainer reads it by global sample index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from train_helpers import VOCAB

from contracts.spec import RunSpec
from megatron_runs import cpu_compat
from megatron_runs.data_prep import PreparedData, halves

cpu_compat.apply()
from megatron_runs import blend  # noqa: E402


@pytest.fixture(scope="module")
def prefixes(nw_home: Path) -> list[str]:
    demo = next((nw_home / "data").glob("demo-*/text_document.idx"))
    return halves(PreparedData(str(demo.with_suffix("")), ""))


def _spec(data: dict, steps: int = 100, eval_iters: int = 2) -> RunSpec:
    return RunSpec.model_validate({
        "name": "unit",
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "seq_length": 64, "vocab_size": VOCAB},
        "training": {"train_steps": steps, "global_batch_size": 8, "eval_iters": eval_iters},
        "data": data,
    })  # fmt: skip


def _blend(prefixes: list[str], split: str = "90,10") -> dict:
    return {
        "blend": [{"prefix": prefixes[0], "weight": 3}, {"prefix": prefixes[1], "weight": 1}],
        "split": split,
    }


def test_the_blend_follows_its_weights_and_the_sizes_the_run_needs(prefixes) -> None:
    train, valid = blend.build(_spec(_blend(prefixes)))
    assert len(train.dataset) == 800  # train_steps × global batch
    assert valid is not None and len(valid.dataset) == 16  # eval_iters × global batch, fixed
    ids = np.array([train.dataset[g]["dataset_id"] for g in range(800)])
    assert np.bincount(ids).tolist() == [600, 200]
    assert all(train.row(g).shape == (65,) for g in range(0, 800, 97))


def test_order_is_a_pure_function_of_the_index_and_wraps_past_the_end(prefixes) -> None:
    a, va = blend.build(_spec(_blend(prefixes)))
    b, vb = blend.build(_spec(_blend(prefixes)))
    for g in (0, 1, 7, 399, 799):
        assert np.array_equal(a.row(g), b.row(g))
        assert np.array_equal(a.row(g + 800), a.row(g))  # a cursor skips pushed past the end
    assert all(np.array_equal(va.row(i), vb.row(i)) for i in range(16))
    assert not np.array_equal(a.row(0), a.row(1))


def test_a_single_prefix_with_a_split_and_without_a_valid_share(prefixes) -> None:
    train, valid = blend.build(_spec({"prefix": prefixes[0], "split": "100,0"}))
    assert valid is None and len(train.dataset) >= 800


def test_a_split_that_leaves_a_dataset_without_documents_is_refused(prefixes) -> None:
    with pytest.raises(ValueError, match=r"leaves the valid split of .*half0 without documents"):
        blend.build(_spec(_blend(prefixes, split="99.9,0.1")))


def test_the_halves_hold_every_document_once_and_are_built_once(nw_home: Path, prefixes) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    demo = next((nw_home / "data").glob("demo-*/text_document.idx"))
    source = IndexedDataset(str(demo.with_suffix("")))
    a, b = (IndexedDataset(p) for p in prefixes)
    assert (len(a), len(b)) == ((len(source) + 1) // 2, len(source) // 2)
    assert np.array_equal(np.asarray(b[0]), np.asarray(source[1]))
    mtime = Path(prefixes[0] + ".bin").stat().st_mtime_ns
    assert halves(PreparedData(str(demo.with_suffix("")), "")) == prefixes
    assert Path(prefixes[0] + ".bin").stat().st_mtime_ns == mtime
