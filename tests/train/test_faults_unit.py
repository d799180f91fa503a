"""Fault selection and effects, from the spec only and tied to their cause."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import spec_dict

from contracts.spec import RunSpec
from megatron_runs.faults import Faults, pin_name, pinned_node

FAULTS = [
    {"kind": "poison_data", "start_sample": 40, "end_sample": 48, "effect": "nan"},
    {"kind": "poison_data", "start_sample": 100, "end_sample": 101},
    {"kind": "node", "node": "n2", "effect": "nan_grads", "after_step": 5},
    {"kind": "node", "node": "n2", "effect": "slow", "slow_factor": 4.0},
    {"kind": "node", "node": "n3", "effect": "crash"},
    {"kind": "crash", "step": 7, "rank": 1},
    {"kind": "corrupt_checkpoint", "step": 6},
]


def _faults(node: str, ckpt: Path, rank: int = 0) -> Faults:
    spec = RunSpec.model_validate(spec_dict("f", faults=FAULTS))
    return Faults.for_process(spec, node, rank, ckpt)


def test_no_faults_section_means_no_effects(tmp_path: Path) -> None:
    f = Faults.for_process(RunSpec.model_validate(spec_dict("f")), "n2", 1, tmp_path)
    assert f == Faults()  # the production default
    f.before_step(10)
    f.poison_grads([])  # no model touched: nothing to poison
    assert f.poison_effect(42) is None and not f.nan_grads(10) and f.slow_delay(10, 1.0) == 0
    assert f.straggle(10, 1.0) == 0.0
    assert f.corrupt_after_publish(10, tmp_path) is None
    assert not (tmp_path / ".faults").exists()


def test_sick_node_hooks_poison_grads_and_straggle(tmp_path: Path) -> None:
    class Buffer:
        def __init__(self) -> None:
            self.grad_data = torch.zeros(3)

    class Chunk:
        def __init__(self) -> None:
            self.buffers = [Buffer(), Buffer()]

    model = [Chunk()]
    sick = _faults("n2", tmp_path)
    sick.before_step(4)
    sick.poison_grads(model)
    assert all(not b.grad_data.isnan().any() for b in model[0].buffers)  # nan_grads from step 5
    sick.before_step(5)
    sick.poison_grads(model)
    assert all(b.grad_data[0].isnan() and b.grad_data[1] == 0 for b in model[0].buffers)
    assert sick.straggle(5, 0.01) == pytest.approx(0.03)  # slow_factor 4: 3 × 0.01 s asleep


def test_poison_is_tied_to_sample_indices(tmp_path: Path) -> None:
    f = _faults("n1", tmp_path)
    assert [f.poison_effect(g) for g in (39, 40, 47, 48, 100)] == [
        None,
        "nan",
        "nan",
        None,
        "spike",
    ]


def test_node_faults_follow_the_node_name_and_after_step(tmp_path: Path) -> None:
    sick, healthy = _faults("n2", tmp_path), _faults("n1", tmp_path)
    assert not sick.nan_grads(4) and sick.nan_grads(5) and sick.nan_grads(500)
    assert not healthy.nan_grads(5)
    assert sick.slow_delay(1, 0.5) == 1.5  # a step of 0.5 s takes 4 × 0.5 s
    assert healthy.slow_delay(1, 0.5) == 0.0
    assert _faults("n3", tmp_path).node_effects(0) == {"crash"}


def test_one_shot_faults_fire_once_on_their_rank(tmp_path: Path) -> None:
    first = _faults("n1", tmp_path, rank=1)
    assert first.crash and not _faults("n1", tmp_path, rank=0).crash
    first._mark_fired("crash-step7-rank1.fired")  # what before_step(7) does before exiting
    assert not _faults("n1", tmp_path, rank=1).crash  # the restart does not meet it again
    ckpt = tmp_path / "iter_6"
    ckpt.mkdir()
    (ckpt / "a.distcp").write_bytes(b"a" * 10)
    assert _faults("n1", tmp_path).corrupt_after_publish(6, ckpt) is not None
    assert not _faults("n1", tmp_path).corrupt  # fired once, gone
    assert _faults("n3", tmp_path).node  # node faults recur on every attempt


def test_corrupt_truncates_the_largest_file_of_that_step(tmp_path: Path) -> None:
    ckpt = tmp_path / "iter_6"  # the fired-marker goes to tmp_path/.faults, not a shared path
    ckpt.mkdir()
    (ckpt / "big.distcp").write_bytes(b"a" * 1000)
    (ckpt / "small.pt").write_bytes(b"b" * 10)
    (ckpt / "nightwatch.json").write_text("{}")
    f = _faults("n1", tmp_path)
    assert f.corrupt_after_publish(4, ckpt) is None
    assert f.corrupt_after_publish(6, ckpt) == ckpt / "big.distcp"
    assert (ckpt / "big.distcp").stat().st_size == 500
    assert (ckpt / "small.pt").stat().st_size == 10


def test_a_device_fault_strikes_only_its_local_rank(tmp_path: Path) -> None:
    spec = RunSpec.model_validate(
        spec_dict(
            "f",
            faults=[{"kind": "node", "node": "n2", "effect": "nan_grads", "local_rank": 1}],
        )
    )
    devices = [Faults.for_process(spec, "n2", 4 + i, tmp_path, local_rank=i) for i in range(3)]
    assert [f.nan_grads(1) for f in devices] == [False, True, False]
    assert not Faults.for_process(spec, "n1", 1, tmp_path, local_rank=1).nan_grads(1)


def _placed(node: str, ckpt: Path, job_nodes: tuple[str, ...]) -> Faults:
    spec = RunSpec.model_validate(
        spec_dict("f", faults=[{"kind": "node", "job_node": 1, "effect": "hang", "after_step": 5}])
    )
    return Faults.for_process(spec, node, 0, ckpt, job_nodes=job_nodes)


def test_a_job_node_fault_is_pinned_where_it_first_strikes(tmp_path: Path) -> None:
    """Named by its place in the job: the job's second node at the first strike, and that
    node on every later attempt, wherever the job lands (a soak need not guess placement)."""
    first = ("n4", "n5")
    assert not _placed("n4", tmp_path, first).node
    sick = _placed("n5", tmp_path, first)
    assert sick.node and pinned_node(tmp_path, sick.node[0]) is None
    assert sick.node_effects(4) == set()  # not struck yet: nothing pinned, a restart may move it
    assert pinned_node(tmp_path, sick.node[0]) is None
    assert sick.node_effects(5) == {"hang"}
    assert pinned_node(tmp_path, sick.node[0]) == "n5"
    # The next attempt runs on n2, n5: n5 is sick wherever it stands, n2 not.
    assert _placed("n5", tmp_path, ("n5", "n2")).node_effects(9) == {"hang"}
    assert not _placed("n2", tmp_path, ("n5", "n2")).node
    assert not list((tmp_path / ".faults").glob("*.tmp"))


def test_the_first_rank_to_strike_pins_and_the_others_keep_it(tmp_path: Path) -> None:
    a, b = _placed("n5", tmp_path, ("n4", "n5")), _placed("n5", tmp_path, ("n4", "n5"))
    a.node_effects(5)
    (tmp_path / ".faults" / pin_name(a.node[0])).write_text("n5\n")
    b.node_effects(6)  # a second rank of the node: the pin stands
    assert pinned_node(tmp_path, b.node[0]) == "n5"
    assert not b.to_pin and not a.to_pin


def test_a_named_node_fault_has_no_pin(tmp_path: Path) -> None:
    f = _faults("n2", tmp_path)
    f.node_effects(10)
    assert not (tmp_path / ".faults").exists()
