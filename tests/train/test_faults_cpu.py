"""Injected faults in a real single-rank run: each shows up as its cause predicts."""

from __future__ import annotations

import math
import time

import pytest
from train_helpers import spec_dict

from contracts import anomalies, exitcodes

pytestmark = pytest.mark.timeout(300)


def _one_rank(faults: list[dict], steps: int = 4, distributed_optimizer: bool = True) -> dict:
    spec = spec_dict(
        "faults1", tp=1, pp=1, dp=1, steps=steps, interval=100, faults=faults, layers=2
    )
    spec["parallelism"]["distributed_optimizer"] = distributed_optimizer
    return spec


SICK = [
    {"kind": "poison_data", "start_sample": 8, "end_sample": 16, "effect": "spike"},
    {"kind": "node", "node": "n-sick", "effect": "nan_grads", "after_step": 3},
    {"kind": "node", "node": "n-other", "effect": "crash", "after_step": 2},
]


@pytest.mark.parametrize("distributed_optimizer", [True, False], ids=["distopt", "fp32opt"])
def test_spike_and_nan_grads_on_the_sick_node_keep_the_run_alive(
    run_train, tmp_path, distributed_optimizer: bool
) -> None:
    """NaN grads skip the update with either optimizer kind (fp32 without the distributed
    optimizer used to apply them: T4 — the loss after the NaN step was NaN for good)."""
    spec = _one_rank(SICK, distributed_optimizer=distributed_optimizer)
    run = run_train(spec, tmp_path / "ck", env={"SLURMD_NODENAME": "n-sick"})
    assert run.wait(240) == [exitcodes.OK]  # n-other's crash is not this node's
    steps = {e["step"]: e for e in run.events() if e["event"] == "step"}
    assert sorted(steps) == [1, 2, 3, 4]
    assert steps[2]["loss"] > 5 * steps[1]["loss"]  # samples 8..15 are garbage
    assert all(math.isfinite(steps[s]["grad_norm"]) for s in (1, 2))
    for s in (3, 4):  # NaN grads: update skipped, loss still finite, run goes on
        assert steps[s]["skipped_update"] and math.isnan(steps[s]["grad_norm"])
        assert math.isfinite(steps[s]["loss"])


def test_node_crash_recurs_on_that_node(run_train, tmp_path) -> None:
    run = run_train(_one_rank(SICK), tmp_path / "ck", env={"SLURMD_NODENAME": "n-other"})
    assert run.wait(240) == [exitcodes.INJECTED_CRASH]
    assert [e["step"] for e in run.events() if e["event"] == "step"] == [1]


def test_node_hang_stops_step_progress(run_train, tmp_path) -> None:
    faults = [{"kind": "node", "node": "n-hang", "effect": "hang", "after_step": 2}]
    run = run_train(_one_rank(faults), tmp_path / "ck", env={"SLURMD_NODENAME": "n-hang"})
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not run.losses():
            assert run.poll()[0] is None, run.logs[0].read_text()[-2000:]
            time.sleep(0.2)
        assert list(run.losses()) == [1]
        time.sleep(3)
        assert run.poll()[0] is None and list(run.losses()) == [1]
        assert any(e["event"] == "injected_hang" for e in run.events())
    finally:
        run.kill()


def test_a_nan_made_by_one_device_is_its_nodes(run_train, tmp_path) -> None:
    """One bad device (local rank 1 of two, DP 2): its NaN reaches every rank through the
    gradient reduction, and the step still names the node it was made on (only local rank 0
    checked its own gradients before, so a bad device on any other rank went unnamed)."""
    faults = [{"kind": "node", "node": "n-sick", "effect": "nan_grads", "after_step": 2,
               "local_rank": 1}]  # fmt: skip
    spec = spec_dict("faults-dev", tp=1, pp=1, dp=2, steps=3, interval=100, faults=faults)
    spec["model"]["num_layers"] = 2
    run = run_train(spec, tmp_path / "ck", env={"SLURMD_NODENAME": "n-sick"})
    assert run.wait(240) == [exitcodes.OK, exitcodes.OK]
    steps = {e["step"]: e for e in run.events() if e["event"] == "step"}
    assert steps[1]["nonfinite_nodes"] == [] and not steps[1]["skipped_update"]
    for s in (2, 3):
        assert steps[s]["skipped_update"] and steps[s]["nonfinite_nodes"] == ["n-sick"]


def test_a_slow_node_is_named_by_the_trainer_and_no_other(run_train, tmp_path) -> None:
    """Two ranks on two nodes (DP 2), n-b's steps 3× slower from step 3: the step's
    all-reduce carries each rank's busy time, and the trainer records n-b as a straggler once
    it was slow in more than half of its last 8 steps or above twice the other's in its last
    4: n-a never, and n-b once (one episode). Without noise that is step 6 or 7 at the soonest,
    but a loaded machine can make one of n-b's two healthy steps look slow too, so the exact
    bound is the one the detector itself sets: five steps seen for a majority of 8, four for
    the severe window."""
    faults = [{"kind": "node", "node": "n-b", "effect": "slow", "after_step": 3}]
    spec = spec_dict("straggler", tp=1, pp=1, dp=2, steps=16, interval=100, faults=faults)
    spec["model"]["num_layers"] = 2
    spec["recovery"] = {"straggler_steps": 8}
    nodes = [{"SLURMD_NODENAME": "n-a"}, {"SLURMD_NODENAME": "n-b"}]
    run = run_train(spec, tmp_path / "ck", rank_env=nodes)
    assert run.wait(240) == [exitcodes.OK, exitcodes.OK]
    named = [a for a in anomalies.read(tmp_path / "ck") if a.kind == anomalies.STRAGGLER]
    assert [a.nodes for a in named] == [("n-b",)] and named[0].window_steps in (8, 4)
    assert min(named[0].window_steps, 5) <= named[0].step <= 16
    assert named[0].ratio > (2.0 if named[0].window_steps == 4 else 1.5)
    logged = [e for e in run.events() if e["event"] == "straggler"]
    assert {(e["node"], e["step"]) for e in logged} == {("n-b", named[0].step)}
