"""The soak's run spec, modes and baseline job script, checked without any service."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.chaos_soak import (
    Mode,
    _without_seeds,
    acceptance,
    cluster_size,
    mode_from_args,
    parse_args,
    parse_seeds,
    soak_spec,
    steps_for,
)
from benchmarks.soak.baseline import ReferenceMismatch, load_reference, sbatch_script
from benchmarks.soak.faults import elapsed_minutes
from benchmarks.soak.reference import ReferencePlan, Segment
from benchmarks.soak.schedule import SHORT_KINDS, FaultKind, SoakShape, draw
from benchmarks.soak.score import FaultScore, SystemScore
from contracts.spec import RunSpec
from megatron_runs.faults import truncate_largest
from supervisor.layout import layout_errors

DATA = {"prefix": "/data/demo/text_document", "tokenizer": "/data/demo/tokenizer.json"}


def test_modes() -> None:
    short = mode_from_args(parse_args(["--short"]))
    assert short.kinds == SHORT_KINDS and short.systems == ("nightwatch",)
    clean = mode_from_args(parse_args(["--clean", "--minutes", "30", "--step-seconds", "0.5"]))
    assert clean.kinds == () and clean.train_steps == 3600
    full = mode_from_args(parse_args(["--faults", "hang,walltime", "--steps", "300"]))
    assert full.kinds == (FaultKind.HANG, FaultKind.WALLTIME)
    assert full.systems == ("nightwatch", "baseline") and full.train_steps == 300
    # --minutes alone waits for the pace measured on this machine
    assert mode_from_args(parse_args(["--minutes", "20"])).train_steps is None


def test_minutes_become_the_steps_they_take_at_the_pace() -> None:
    assert steps_for(20, 0.06) == 20000 and steps_for(20, 0.16) == 7500
    assert steps_for(0.001, 10.0) == 1  # never an empty run


def test_soak_spec_is_a_valid_run_with_the_schedules_faults() -> None:
    mode = Mode(tuple(FaultKind), 1200, 20, ("nightwatch", "baseline"))
    nodes = tuple(f"n{i}" for i in range(1, 8))
    schedule = draw(4, SoakShape(1200, 20, 8, 4, nodes, 2), mode.kinds)
    spec = RunSpec.model_validate(soak_spec(mode, schedule, DATA))
    assert layout_errors(spec) == []
    assert spec.parallelism.world_size == spec.resources.world_size == 4
    assert len(spec.faults) == 4  # poison + three sick nodes
    assert spec.recovery.max_excluded_nodes == 4
    # A node fault moves to the job's spare inside the running job (no new sbatch).
    assert spec.resources.spare_nodes == 1 and spec.recovery.restart_in_job


def test_the_cluster_holds_the_job_its_spare_and_a_node_for_each_node_fault() -> None:
    assert cluster_size(Mode((), 100, 10, ())) == 2 + 1 + 1
    short = mode_from_args(parse_args(["--short"]))  # one node fault: the NaN node
    assert cluster_size(short) == 2 + 1 + 1 + 1
    full = mode_from_args(parse_args([]))  # NaN node, hang, straggler, node death
    assert cluster_size(full) == 2 + 1 + 4 + 1


def test_baseline_script_requeues_and_resumes_the_same_program(tmp_path: Path) -> None:
    spec = soak_spec(Mode((), 100, 10, ()), None, DATA)
    text = sbatch_script(spec, tmp_path / "spec.json", tmp_path, "baseline")
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=USR2@90" in text
    # The job's nodes alone: the baseline has no spare to move to (nor the reference).
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=2" in text
    assert "-m megatron_runs.train" in text and '--attempt "$SLURM_RESTART_COUNT"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "--resume-step" not in text  # resumes from `latest`, like Megatron's auto-resume
    # a CPU spec trains on CPU on a GPU host too
    assert "PYTHONPATH=" in text and text.count(" CUDA_VISIBLE_DEVICES=\n") == 1
    gpu = {**spec, "resources": {**spec["resources"], "device": "gpu"}}
    assert "CUDA_VISIBLE_DEVICES" not in sbatch_script(gpu, tmp_path / "s.json", tmp_path, "b")
    segment = sbatch_script(spec, tmp_path / "spec.json", tmp_path, "reference",
                            ["--resume-step", "60", "--skip", "100:120"])  # fmt: skip
    assert '"$SLURM_RESTART_COUNT" --resume-step 60 --skip 100:120' in segment


def test_walltime_and_corruption_helpers(tmp_path: Path) -> None:
    assert elapsed_minutes("0:40") == 0
    assert elapsed_minutes("5:30") == 5
    assert elapsed_minutes("1:02:03") == 62
    assert elapsed_minutes("1-00:00:10") == 1440
    (tmp_path / "nightwatch.json").write_text("{}")
    (tmp_path / "big.distcp").write_bytes(b"x" * 100)
    (tmp_path / "small.distcp").write_bytes(b"x" * 10)
    assert truncate_largest(tmp_path) == tmp_path / "big.distcp"
    assert (tmp_path / "big.distcp").stat().st_size == 50


def test_acceptance_names_what_failed() -> None:
    ok = SystemScore(
        "nightwatch", 100.0, 150, 150, True, 150, 0, 0.5, 0.9, 6.0, 6.0, 0.0, 0, 0, 0, 0, [],
        loss_equal=True, loss_steps_compared=150,
    )  # fmt: skip
    assert acceptance(ok, clean=True) == []
    bad = SystemScore(
        "nightwatch", 100.0, 90, 150, False, 90, 0, 0.5, 0.9, 6.0, 7.0, 0.14, 2, 1, 0, 1, []
    )
    failed = acceptance(bad, clean=True)
    assert any("step 90" in f for f in failed) and any("escalation" in f for f in failed)
    assert any("2 remedies" in f for f in failed)
    assert acceptance(ok, clean=False, ettr_min=0.4) == []
    unseen = FaultScore(
        "poison_data", 29, 10.0, True, [], False, None, None, False, False, None, 0,
        "armed in spec; no remedy; the final model trained its samples at steps [29, 30, 31] "
        "(update skipped at [])",
    )  # fmt: skip
    assert acceptance(dataclasses.replace(ok, faults=[unseen]), clean=False) == [
        "poison_data: cured by None, remedies [] (armed in spec; no remedy; the final model "
        "trained its samples at steps [29, 30, 31] (update skipped at []))"
    ]
    assert acceptance(ok, clean=False, ettr_min=0.95) == ["ETTR 0.5 below 95%"]
    # Exact or not: one step off in the last bit fails, however close the final loss.
    off = dataclasses.replace(
        ok, loss_equal=False, loss_steps_unequal=1, loss_mismatches=[(149, 6.1, 6.2)]
    )
    assert acceptance(off, clean=True) == [
        "loss differs from the exact reference at 1 of 150 steps (first: step, loss, "
        "reference [(149, 6.1, 6.2)]); final 6.0 vs 6.0"
    ]
    unreferenced = dataclasses.replace(ok, loss_equal=None, loss_steps_compared=0)
    assert acceptance(unreferenced, clean=True)[0].startswith(
        "loss differs from the exact reference at 0 of 0 steps"
    )
    assert acceptance(unreferenced, clean=True, compare_loss=False) == []
    # A remedy no fault explains; a rollback past more than the window; a contained fault
    # that cost steps: each fails on its own.
    fp = dataclasses.replace(ok, false_positives=1)
    assert acceptance(fp, clean=False) == ["1 false positive(s)"]
    cured = FaultScore(
        "poison_data", 29, 10.0, True, ["rollback"], True, 1.0, "rollback", True, True, 3.0, 9,
        samples_skipped=40, skip_allowance=24,
    )  # fmt: skip
    assert acceptance(dataclasses.replace(ok, faults=[cured]), clean=False) == [
        "poison_data: 40 samples skipped, more than the window and its margin (24)"
    ]
    held = dataclasses.replace(cured, cured_by="contained", samples_skipped=0, steps_lost=2)
    assert acceptance(dataclasses.replace(ok, faults=[held]), clean=False) == [
        "poison_data: contained, yet 2 steps lost"
    ]
    # Without a reference a fault soak measures, but cannot pass: its loss point is unproven.
    assert acceptance(unreferenced, clean=False, compare_loss=False) == [
        "final loss not compared: no fault-free reference (--no-reference)"
    ]


def test_a_sweep_names_its_seeds_and_runs_each_without_the_sweep_flags() -> None:
    assert parse_seeds("1-3,7") == [1, 2, 3, 7]
    assert parse_args(["--short", "--seeds", "1-20"]).seeds == list(range(1, 21))
    for bad in ("3-1", "x", ","):
        with pytest.raises(SystemExit):
            parse_args(["--seeds", bad])
    argv = ["--short", "--seeds", "1-3", "--out", "/tmp/x", "--base-port", "18100", "--seed=4"]
    assert _without_seeds(argv) == ["--short", "--base-port", "18100"]


def test_a_reference_is_reused_only_for_its_own_spec(tmp_path: Path) -> None:
    """A re-soak may skip the fault-free reference (its spec alone decides it), never with
    a reference of another spec or one that stopped short."""
    spec = {
        "training": {"train_steps": 2},
        "checkpoint": {"interval_steps": 10, "keep_last": 3},
        "faults": [],
    }
    (tmp_path / "logs").mkdir()
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "run.json").write_text(json.dumps({"submit_t": 100.0, "end_t": 130.0}))
    lines = [
        {"ts": 110.0, "event": "train_start", "step": 0, "attempt": 0, "job_id": "1"},
        {"ts": 120.0, "event": "step", "step": 1, "loss": 5.0, "attempt": 0, "job_id": "1"},
    ]
    log = tmp_path / "logs" / "1_0_log.out"
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ReferenceMismatch, match="stopped at step 1"):
        load_reference(tmp_path, spec)
    last = {"ts": 130.0, "event": "step", "step": 2, "loss": 4.0, "attempt": 0, "job_id": "1"}
    log.write_text(log.read_text() + json.dumps(last) + "\n")
    ref = load_reference(tmp_path, spec)
    assert (ref.submit_t, ref.end_t, ref.progress.max_step) == (100.0, 130.0, 2)
    with pytest.raises(ReferenceMismatch, match="not this soak"):
        load_reference(tmp_path, {**spec, "training": {"train_steps": 3}})
    # the supervisor's recovery settings are not the training program's: a clean soak may
    # reuse the reference of a fault schedule (which allows more node exclusions)
    retention = {"interval_steps": 10, "keep_last": 5, "keep_seconds": 30}
    clean = {**spec, "recovery": {"max_excluded_nodes": 2}, "checkpoint": retention}
    assert load_reference(tmp_path, clean).progress.max_step == 2
    # An exact reference is reused only for the same plan: a record without one was a
    # clean run, which is the plan of a run that skipped nothing.
    assert load_reference(tmp_path, spec, ReferencePlan((Segment(0, 2),))).progress.max_step == 2
    with pytest.raises(ReferenceMismatch, match="another plan"):
        load_reference(tmp_path, spec, ReferencePlan((Segment(0, 2, ((8, 16),)),)))
    poisoned = ReferencePlan((Segment(0, 2),), ({"kind": "poison_data"},))
    with pytest.raises(ReferenceMismatch, match="not this soak's reference spec"):
        load_reference(tmp_path, spec, poisoned)
