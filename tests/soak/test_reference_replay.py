"""The exact reference's one assumption beyond the data order, checked with the real trainer.

`reference.plan` re-creates an update that a NaN node made the trainer throw away with a NaN
poison over that step's samples. That is exact only if both leave the model and optimizer
state untouched, so that every later step is equal bit for bit. Three short CPU runs of the
soak's model and layout (TP 1 × PP 2 × DP 2, distributed optimizer) show it: a sick device
throws steps 10 and 11 away and the run resumes without it, against one run whose steps 10
and 11 meet poisoned samples, and against a clean run, which differs from step 10 on
(≈ 45 s on two cores).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks.chaos_soak import Mode, soak_spec
from benchmarks.soak.progress import parse_lines
from benchmarks.soak.reference import compare_losses, plan
from megatron_runs.data_prep import prepare
from worker.local_launch import launch

pytestmark = [pytest.mark.slow]

STEPS, SICK_FROM, SICK_TO = 20, 10, 11


def _train(spec: dict, work: Path, name: str, args: list[str], attempt: int = 1) -> list[str]:
    """One run of 4 CPU ranks on "node" n1 (the attempt number tells its log apart)."""
    spec_path = work / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    ckpt = work / "ckpt-sick" if name.startswith("sick") else work / f"ckpt-{name}"
    run = launch(
        [
            "--spec",
            str(spec_path),
            "--checkpoint-dir",
            str(ckpt),
            "--run-id",
            name,
            "--attempt",
            str(attempt),
            *args,
        ],
        4,
        work / name,
        env={"SLURMD_NODENAME": "n1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        python=sys.executable,
    )
    assert run.wait(timeout=600) == [0, 0, 0, 0], run.logs
    return run.logs[0].read_text(errors="replace").splitlines()


def test_a_skipped_update_recreated_by_poisoned_samples_leaves_the_same_state(
    tmp_path: Path,
) -> None:
    data = prepare(None, Path(tempfile.gettempdir()) / "nightwatch-soak-data", 4096)
    spec = soak_spec(
        Mode((), STEPS, 10, ("nightwatch",)),
        None,
        {"prefix": data.prefix, "tokenizer": data.tokenizer_path},
    )
    device = {"kind": "node", "node": "n1", "local_rank": 1, "effect": "nan_grads"}
    sick = {**spec, "faults": [{**device, "after_step": SICK_FROM}]}
    lines = _train(sick, tmp_path, "sick", ["--stop-at-step", str(SICK_TO)])
    lines += _train(spec, tmp_path, "sick-resumed", [], attempt=2)  # the node is gone: resume at 11
    nightwatch = parse_lines(lines)
    bad = sorted(e.step for e in nightwatch.steps if e.skipped_update)
    assert bad == [SICK_FROM, SICK_TO]
    ref_plan = plan(nightwatch, [], spec["training"]["global_batch_size"])
    assert ref_plan.emulated_steps == (SICK_FROM, SICK_TO)
    assert len(ref_plan.segments) == 1  # no skip: one clean run
    reference = parse_lines(_train({**spec, "faults": list(ref_plan.faults)}, tmp_path, "ref", []))
    match = compare_losses(nightwatch, reference, ref_plan.emulated_steps)
    assert match.compared == STEPS and match.mismatches == ()
    # Not vacuous: a reference that applies those two updates differs at every later step.
    clean = parse_lines(_train(spec, tmp_path, "clean", []))
    differ = [step for step, _, _ in compare_losses(nightwatch, clean).mismatches]
    assert differ == list(range(SICK_FROM, STEPS + 1))
