"""The fault schedule is a pure, replayable function of the seed."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.soak.schedule import (
    INFRA_FAULTS,
    NODE_FAULTS,
    SHORT_KINDS,
    FaultKind,
    Schedule,
    SoakShape,
    draw,
    first_fault_step,
    parse_kinds,
)
from contracts.spec import RunSpec

SHAPE = SoakShape(
    train_steps=600,
    checkpoint_interval=10,
    global_batch_size=8,
    world_size=4,
    nodes=("n1", "n2", "n3", "n4", "n5", "n6"),
    job_nodes=2,
)
ALL = list(FaultKind)


def test_same_seed_same_schedule_and_other_seed_differs() -> None:
    a, b, c = draw(7, SHAPE, ALL), draw(7, SHAPE, ALL), draw(8, SHAPE, ALL)
    assert a == b
    assert a.render() == b.render()
    assert a.faults != c.faults


def test_every_kind_once_in_order_spaced_after_two_checkpoints() -> None:
    s = draw(3, SHAPE, ALL)
    assert sorted(f.kind for f in s.faults) == sorted(ALL)
    steps = [f.at_step for f in s.faults]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert steps[0] >= first_fault_step(SHAPE)
    assert steps[-1] < SHAPE.train_steps - SHAPE.checkpoint_interval
    # at least a checkpoint interval between faults: room to recover
    assert min(b - a for a, b in itertools.pairwise(steps)) >= 10


def test_json_round_trip_replays_exactly() -> None:
    s = draw(11, SHAPE, ALL)
    assert Schedule.from_dict(s.to_dict()) == s
    assert "seed 11" in s.render() and "node_death" in s.render()


def test_spec_faults_validate_against_the_run_spec() -> None:
    s = draw(5, SHAPE, ALL)
    spec = RunSpec.model_validate(
        {
            "name": "soak",
            "model": {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2,
                      "seq_length": 16, "vocab_size": 64},
            "training": {"train_steps": 600},
            "faults": s.spec_faults(),
        }
    )  # fmt: skip
    kinds = {f.kind for f in spec.faults}
    assert kinds == {"poison_data", "node"}
    poison = next(f for f in spec.faults if f.kind == "poison_data")
    fault = next(f for f in s.faults if f.kind is FaultKind.POISON_DATA)
    # step s (1-based) consumes samples [(s-1)·B, s·B): the window starts at the fault step
    assert poison.start_sample == (fault.at_step - 1) * 8
    assert not any(f.spec_side for f in s.faults if f.kind is FaultKind.NODE_DEATH)


def test_node_faults_name_a_place_in_the_job_not_a_node() -> None:
    """Where SLURM puts a restarted job is not predictable: a fault names a job slot, and the
    training program (spec-side) or the driver (node death) finds the node there."""
    for seed in range(10):
        places = [f.params for f in draw(seed, SHAPE, ALL).faults if f.kind in NODE_FAULTS]
        assert len(places) == 4
        assert all("node" not in p and 0 <= p["job_node"] < SHAPE.job_nodes for p in places)
    spec_side = [f for f in draw(9, SHAPE, ALL).spec_faults() if f["kind"] == "node"]
    assert spec_side and all("node" not in f and "job_node" in f for f in spec_side)


def test_too_few_nodes_or_steps_is_refused_with_numbers() -> None:
    small = SoakShape(600, 10, 8, 4, ("n1", "n2", "n3"), 2)
    with pytest.raises(ValueError, match="node faults"):
        draw(1, small, [FaultKind.NAN_NODE, FaultKind.HANG])
    short = SoakShape(40, 10, 8, 4, SHAPE.nodes, 2)
    with pytest.raises(ValueError, match="train steps"):
        draw(1, short, ALL)


def test_corrupt_checkpoint_crashes_after_the_checkpoint_it_corrupts() -> None:
    for seed in range(20):
        f = next(x for x in draw(seed, SHAPE, ALL).faults
                 if x.kind is FaultKind.CORRUPT_CHECKPOINT)  # fmt: skip
        ckpt = f.params["checkpoint_step"]
        assert ckpt % 10 == 0 and ckpt < f.at_step < ckpt + 10


def test_parse_kinds() -> None:
    assert parse_kinds(None, SHORT_KINDS) == list(SHORT_KINDS)
    assert parse_kinds("hang, walltime", SHORT_KINDS) == [FaultKind.HANG, FaultKind.WALLTIME]
    with pytest.raises(ValueError, match="valid: poison_data"):
        parse_kinds("gremlins", SHORT_KINDS)
    assert FaultKind.SUPERVISOR_KILL in INFRA_FAULTS


def test_spike_windows_last_the_detectors_sustain_steps() -> None:
    for seed in range(30):
        f = next(x for x in draw(seed, SHAPE, ALL).faults if x.kind is FaultKind.POISON_DATA)
        steps = (f.params["end_sample"] - f.params["start_sample"]) // SHAPE.global_batch_size
        assert steps >= (3 if f.params["effect"] == "spike" else 1)
