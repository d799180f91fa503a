"""Layout validation and the memory estimate (pure), held to peaks measured on GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from contracts.spec import RunSpec
from supervisor.layout import (
    GB,
    activation_bytes_per_token,
    layout_errors,
    layout_report,
    parameter_count,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
#: `benchmarks/memory_calibration.py` on 4 × H200: each layout's spec and measured peaks.
CALIBRATION = REPO / "docs" / "data" / "memory_calibration_h200x4.json"
#: The same on 2 × H200, with sequence parallelism and recomputation.
CALIBRATION_2 = REPO / "docs" / "data" / "memory_calibration_h200x2.json"
#: The same on 2 × H200: pipeline 2 without and with the interleaved (virtual) pipeline.
CALIBRATION_VPP = REPO / "docs" / "data" / "memory_calibration_vpp_h200x2.json"


def llama8b(**overrides: dict[str, Any]) -> RunSpec:
    """The 8B example spec with sections patched."""
    data = RunSpec.from_file(EXAMPLES / "llama-8b-32gpu.yaml").model_dump()
    for section, values in overrides.items():
        data[section] = {**data[section], **values}
    return RunSpec.model_validate(data)


def one_gpu_8b() -> RunSpec:
    return llama8b(
        parallelism={"tensor": 1, "pipeline": 1, "data": 1, "sequence_parallel": False},
        resources={"nodes": 1, "gpus_per_node": 1, "gpu_memory_gib": 80},
        training={"micro_batch_size": 8, "global_batch_size": 8},
    )


def test_8b_has_about_8b_parameters_and_144_gb_of_model_states() -> None:
    """18 B a parameter: bf16 weights, fp32 gradient buffers, fp32 master weights + Adam."""
    report = layout_report(one_gpu_8b())
    assert 7.9e9 < parameter_count(one_gpu_8b()) < 8.1e9
    assert report.memory.model_states_total_bytes == 18 * parameter_count(one_gpu_8b())


@pytest.mark.parametrize(
    "row",
    [
        *json.loads(CALIBRATION.read_text()),
        *json.loads(CALIBRATION_2.read_text()),
        *json.loads(CALIBRATION_VPP.read_text()),
    ],
    ids=lambda r: r["layout"],
)
def test_estimate_is_within_15_percent_above_the_measured_peak(row: dict[str, Any]) -> None:
    """The issue's target: within 15 % of the measured peak, never below it by more than 5 %
    (here: never below at all)."""
    estimate = layout_report(RunSpec.model_validate(row["spec"])).memory.total_bytes / GB
    assert 0 <= estimate / row["measured_gb"] - 1 <= 0.15, (estimate, row["measured_gb"])


def test_activations_follow_the_measured_bytes_per_token() -> None:
    """1.3B (h 2048, GELU MLP 4h) without tensor parallelism: 34 B per token per hidden unit
    per layer, as measured (allocated peaks within 3 % of the model on 4 of the layouts)."""
    row = next(r for r in json.loads(CALIBRATION.read_text()) if r["layout"] == "dp4-mb8")
    spec = RunSpec.model_validate(row["spec"])
    assert activation_bytes_per_token(spec) == 34 * spec.model.hidden_size
    tp2 = RunSpec.model_validate({**row["spec"], "parallelism": {"tensor": 2, "data": 2}})
    assert activation_bytes_per_token(tp2) == (10 + 24 / 2) * spec.model.hidden_size


def test_8b_cannot_train_on_one_80gb_gpu_and_says_why() -> None:
    report = layout_report(one_gpu_8b())
    assert not report.ok
    assert report.memory.total_bytes / GB > 150
    (problem,) = report.errors
    assert problem.field == "resources.gpu_memory_gib"
    assert "276.9 GB" in problem.message and "80 GiB" in problem.message


def test_8b_recipe_fits_on_32_gpus_with_131072_tokens_per_step() -> None:
    report = layout_report(llama8b())
    assert report.ok, report.problems
    assert report.world_size == 32
    assert report.microbatches_per_step == 4
    assert report.tokens_per_step == 131_072
    assert report.steps_for_token_budget == pytest.approx(2.29e6, rel=0.01)
    assert 30 < report.memory.total_bytes / GB < 40


def test_distributed_optimizer_shards_optimizer_states_over_data() -> None:
    on = layout_report(llama8b()).memory
    off = layout_report(llama8b(parallelism={"distributed_optimizer": False})).memory
    assert off.optimizer_bytes == pytest.approx(4 * on.optimizer_bytes)
    assert off.weights_bytes == on.weights_bytes


@pytest.mark.parametrize("name", ["tiny-cpu", "gpt-1.3b-4gpu", "llama-8b-32gpu"])
def test_examples_validate(name: str) -> None:
    spec = RunSpec.from_file(EXAMPLES / f"{name}.yaml")
    assert layout_errors(spec) == []


def errors_of(spec: RunSpec) -> dict[str, str]:
    return {p.field: p.message for p in layout_report(spec).errors}


def test_world_size_mismatch_names_both_products() -> None:
    errs = errors_of(llama8b(resources={"nodes": 3}))
    assert "3 × 8 = 24 GPUs" in errs["resources"]
    assert "4 × 2 × 4 = 32" in errs["resources"]


@pytest.mark.parametrize(
    ("overrides", "field", "numbers"),
    [
        ({"model": {"num_attention_heads": 30, "num_query_groups": 6}},
         "model.num_attention_heads", "30"),
        ({"model": {"num_query_groups": 2}}, "model.num_query_groups", "2 KV groups"),
        ({"model": {"num_layers": 47}}, "model.num_layers", "47 layers"),
        ({"training": {"global_batch_size": 66}}, "training.global_batch_size", "4 × 4 = 16"),
        ({"parallelism": {"virtual_pipeline": 5}}, "parallelism.virtual_pipeline", "2 × 5 = 10"),
        ({"resources": {"gpu_memory_gib": 8}}, "resources.gpu_memory_gib", "8 GiB"),
        ({"resources": {"exclude": ["n1", "n1"]}}, "resources.exclude", "twice"),
    ],
)  # fmt: skip
def test_each_layout_rule_names_field_and_numbers(
    overrides: dict[str, Any], field: str, numbers: str
) -> None:
    errs = errors_of(llama8b(**overrides))
    assert field in errs, errs
    assert numbers in errs[field]
    assert any(line.startswith(f"{field}: ") for line in layout_errors(llama8b(**overrides)))


def test_few_microbatches_warns_but_does_not_block() -> None:
    report = layout_report(llama8b(training={"global_batch_size": 16}))
    assert report.ok
    warnings = [p for p in report.problems if p.severity == "warning"]
    assert any("1 microbatches per step < pipeline = 2" in p.message for p in warnings)


def test_interleaved_schedule_needs_microbatches_divisible_by_pipeline() -> None:
    spec = llama8b(
        parallelism={"virtual_pipeline": 2}, training={"global_batch_size": 48}
    )  # 3 microbatches, pipeline 2
    assert "divisible by pipeline = 2" in errors_of(spec)["training.global_batch_size"]


def test_interleaved_pipeline_is_accepted_and_holds_more_on_the_first_stage() -> None:
    """Korthikanti et al.: pipeline + (pipeline − 1) / v microbatches in flight."""
    plain = layout_report(llama8b())
    interleaved = layout_report(llama8b(parallelism={"virtual_pipeline": 2}))
    assert interleaved.ok, interleaved.errors
    assert interleaved.memory.activations_bytes == pytest.approx(
        plain.memory.activations_bytes * 2.5 / 2
    )


def test_crash_fault_on_a_rank_outside_the_world_is_rejected() -> None:
    data = RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml").model_dump()
    data["faults"] = [{"kind": "crash", "step": 10, "rank": 4}]
    assert "rank 4 ≥ world size 4" in errors_of(RunSpec.model_validate(data))["faults[0].rank"]


def test_node_fault_names_one_node_or_one_place_in_the_job() -> None:
    data = RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml").model_dump()
    nodes = data["resources"]["nodes"]
    data["faults"] = [{"kind": "node", "job_node": nodes, "effect": "hang"}]
    errs = errors_of(RunSpec.model_validate(data))["faults[0].job_node"]
    assert f"job_node {nodes} ≥ the job's {nodes} nodes" in errs
    for both_or_neither in ({"node": "n1", "job_node": 0}, {}):
        data["faults"] = [{"kind": "node", "effect": "hang", **both_or_neither}]
        with pytest.raises(ValidationError, match="exactly one of node"):
            RunSpec.model_validate(data)


def test_unknown_keys_and_absurd_numbers_are_rejected_by_the_schema() -> None:
    data = RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml").model_dump()
    with pytest.raises(ValidationError, match="num_layerz"):
        RunSpec.model_validate({**data, "model": {**data["model"], "num_layerz": 2}})
    with pytest.raises(ValidationError, match="less than or equal"):
        RunSpec.model_validate({**data, "model": {**data["model"], "num_layers": 10**30}})
    with pytest.raises(ValidationError, match="finite"):
        RunSpec.model_validate({**data, "training": {**data["training"], "lr": float("nan")}})


def test_options_the_trainer_cannot_run_are_rejected_and_those_it_runs_are_estimated() -> None:
    base = RunSpec.model_validate(json.loads(CALIBRATION.read_text())[0]["spec"])
    data = base.model_dump()
    odd = RunSpec.model_validate(
        {
            **data,
            "model": {**data["model"], "seq_length": 2047},
            "parallelism": {
                **data["parallelism"],
                "tensor": 2,
                "data": 2,
                "sequence_parallel": True,
            },
        }
    )
    assert "not divisible by tensor 2" in errors_of(odd)["parallelism.sequence_parallel"]
    plain = layout_report(base).memory.activations_bytes
    full = RunSpec.model_validate({**data, "training": {**data["training"], "recompute": "full"}})
    selective = RunSpec.model_validate(
        {**data, "training": {**data["training"], "recompute": "selective"}}
    )
    assert layout_report(full).memory.activations_bytes < plain / 4
    assert layout_report(selective).memory.activations_bytes == plain
