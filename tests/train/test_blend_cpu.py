"""A blend of two indexed datasets with a train/valid split and a validation loss, on four
CPU ranks (gloo) of real Megatron-Core (TP1×PP2×DP2: the eval's forward-only pipeline
schedule and its all-reduce over data-parallel ranks).

One scenario, shared by the tests below:
* `reference`: 8 steps, evaluation every 2 steps, samples [40, 48) skipped from the start
  (they are poisoned: the run a clean operator would have made);
* `faulty`: the same spec without evaluations and without the skip, stopped after step 6 (its
  step 6 read the poison), checkpoints at 4 and 6;
* `rollback`: attempt 1 on faulty's directory from step 4 with skip 40:48, evaluating again.
"""

from __future__ import annotations

import math

import pytest
from train_helpers import spec_dict

from contracts import checkpoints
from megatron_runs.data_prep import PreparedData, halves

pytestmark = pytest.mark.timeout(600)

POISON = {"kind": "poison_data", "start_sample": 40, "end_sample": 48, "effect": "nan"}
SKIP = ["--skip", "40:48"]


def _spec(name: str, prefixes: list[str], eval_interval: int = 2) -> dict:
    spec = spec_dict(name, tp=1, pp=2, dp=2, steps=8, faults=[POISON])
    spec["data"] = {
        "blend": [{"prefix": prefixes[0], "weight": 3.0}, {"prefix": prefixes[1], "weight": 1.0}],
        "split": "90,10",
    }
    spec["training"].update(eval_interval=eval_interval, eval_iters=2)
    return spec


def _evals(run, rank: int = 0) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in run.events(rank) if e["event"] == "eval"}


@pytest.fixture(scope="module")
def scenario(run_train, nw_home, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("blend")
    demo = next((nw_home / "data").glob("demo-*/text_document.idx"))
    prefixes = halves(PreparedData(str(demo.with_suffix("")), ""))
    out: dict = {"root": root}
    ref = run_train(_spec("blend_ref", prefixes), root / "ref", SKIP)
    out["reference_codes"], out["reference"] = ref.wait(300), ref
    faulty = run_train(
        _spec("blend_faulty", prefixes, eval_interval=0), root / "faulty", ["--stop-at-step", "6"]
    )
    out["faulty_codes"], out["faulty"] = faulty.wait(300), faulty
    rollback = run_train(
        _spec("blend_faulty", prefixes),
        root / "faulty",
        [*SKIP, "--attempt", "1", "--resume-step", "4"],
    )
    out["rollback_codes"], out["rollback"] = rollback.wait(300), rollback
    return out


def test_blend_trains_and_skips_in_global_sample_indices(scenario) -> None:
    assert scenario["reference_codes"] == [0, 0, 0, 0]
    ref = scenario["reference"]
    losses = ref.losses()
    assert sorted(losses) == list(range(1, 9))
    assert all(math.isfinite(v) for v in losses.values())  # the poison was never read
    assert losses[8] < losses[1]
    steps = [e for e in ref.events() if e["event"] == "step"]
    assert [e["consumed"] for e in steps] == [8, 16, 24, 32, 40, 56, 64, 72]


def test_eval_at_the_interval_identical_on_every_rank(scenario) -> None:
    ref = scenario["reference"]
    evals = _evals(ref)
    assert sorted(evals) == [2, 4, 6, 8]
    assert all(math.isfinite(v) for v in evals.values())
    for rank in range(1, 4):
        assert _evals(ref, rank) == evals  # one all-reduced value, bit for bit
    line = next(e for e in ref.events() if e["event"] == "eval")
    assert (line["iters"], line["samples"]) == (2, 16)


def test_eval_changes_no_training_loss(scenario) -> None:
    """faulty never evaluates: before its poison it trains bit for bit like the reference."""
    assert scenario["faulty_codes"] == [0, 0, 0, 0]
    ref, faulty = scenario["reference"].losses(), scenario["faulty"].losses()
    assert {s: faulty[s] for s in (1, 2, 3, 4, 5)} == {s: ref[s] for s in (1, 2, 3, 4, 5)}
    assert _evals(scenario["faulty"]) == {}


def test_rollback_with_skip_equals_the_clean_run(scenario) -> None:
    """The faulty run read the poison at step 6; resumed from step 4 skipping it, it trains
    and evaluates bit for bit like the reference."""
    assert math.isnan(scenario["faulty"].losses()[6])
    ref, ref_evals = scenario["reference"].losses(), _evals(scenario["reference"])
    assert scenario["rollback_codes"] == [0, 0, 0, 0]
    rollback = scenario["rollback"]
    assert rollback.losses() == {s: ref[s] for s in (5, 6, 7, 8)}
    assert _evals(rollback) == {6: ref_evals[6], 8: ref_evals[8]}


def test_checkpoints_record_the_last_eval(scenario) -> None:
    listing = {c.step: c for c in checkpoints.list_checkpoints(scenario["root"] / "ref")}
    evals = _evals(scenario["reference"])
    assert listing[4].last_eval == (4, evals[4])
    assert listing[8].last_eval == (8, evals[8])
    # The rollback evaluated at 6 and 8; what faulty saved at 4 had no evaluation.
    rolled = {c.step: c for c in checkpoints.list_checkpoints(scenario["root"] / "faulty")}
    assert rolled[4].last_eval is None and rolled[8].last_eval == (8, evals[8])
