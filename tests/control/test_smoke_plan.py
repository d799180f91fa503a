"""The smoke check's plan: every example spec shrinks to a spec that validates and keeps its
features; the verdict is read from the ranks' logs (pure functions, no training here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contracts.logs import log_events as events
from contracts.spec import RunSpec
from supervisor.layout import layout_report
from supervisor.smoke.plan import (
    DEMO_VOCAB,
    PHASES,
    STEPS,
    error_tail,
    phase_problems,
    shrink,
)
from supervisor.smoke.run import local_gpus

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def _llama_vpp() -> RunSpec:
    """The 8B example with every feature at once: VPP 3, full recomputation."""
    data = RunSpec.from_file(next(p for p in EXAMPLES if p.stem == "llama-8b-32gpu"))
    return RunSpec.model_validate(
        data.model_dump()
        | {
            "parallelism": data.parallelism.model_dump() | {"virtual_pipeline": 3},
            "training": data.training.model_dump() | {"recompute": "full"},
        }
    )


SPECS = {p.stem: RunSpec.from_file(p) for p in EXAMPLES} | {"llama-vpp-full": _llama_vpp()}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_example_shrinks_to_a_valid_spec_with_its_features(name: str) -> None:
    spec = SPECS[name]
    plan = shrink(spec)
    small = plan.spec
    report = layout_report(small)
    assert report.ok, report.errors
    assert not [p for p in report.problems if p.field.startswith("training.")], report.problems
    p, q = spec.parallelism, small.parallelism
    assert (q.tensor, q.pipeline, q.virtual_pipeline) == (p.tensor, p.pipeline, p.virtual_pipeline)
    assert (q.sequence_parallel, q.distributed_optimizer) == (
        p.sequence_parallel,
        p.distributed_optimizer,
    )
    assert q.data <= 2 and plan.ranks == small.resources.world_size <= 8
    kind = ("normalization", "activation", "position_embedding", "untie_embeddings", "precision")
    assert {k: getattr(small.model, k) for k in kind} == {k: getattr(spec.model, k) for k in kind}
    m, n = spec.model, small.model
    assert n.num_attention_heads // n.kv_groups == m.num_attention_heads // m.kv_groups
    assert (n.num_query_groups is None) == (m.num_query_groups is None)
    assert n.num_layers == p.pipeline * (p.virtual_pipeline or 1)
    assert n.hidden_size <= 512 and n.seq_length <= 64 + p.tensor
    assert n.vocab_size == DEMO_VOCAB and small.data.prefix is None and small.faults == []
    assert small.training.recompute == spec.training.recompute
    assert small.checkpoint.async_save == spec.checkpoint.async_save
    assert small.training.train_steps == STEPS
    assert (plan.device, small.resources.device) == ("cpu", "cpu")  # no GPU given


def test_the_8b_example_says_what_it_gives_up_on_a_cpu_host() -> None:
    plan = shrink(SPECS["llama-8b-32gpu"], gpus=0)
    assert plan.ranks == 8  # TP 4 × PP 2 × DP 1: DP 2 would be 16 ranks
    assert [line.split(":")[0] for line in plan.downgraded] == [
        "parallelism.data",
        "resources.device",
        "model.precision",
    ]
    small = plan.spec.model
    assert (small.num_attention_heads, small.num_query_groups, small.hidden_size) == (16, 4, 256)
    assert small.ffn_hidden_size == 608  # the spec's 9728 / 4096 ratio, a multiple of TP
    mha = shrink(SPECS["tiny-cpu"]).spec.model  # TP 2: two heads on each rank
    assert (mha.num_attention_heads, mha.num_query_groups, mha.hidden_size) == (4, None, 64)


def test_local_gpus_keep_the_spec_on_gpus_and_bf16() -> None:
    plan = shrink(SPECS["gpt-1.3b-4gpu"], gpus=2)
    assert (plan.device, plan.ranks, plan.downgraded) == ("gpu", 2, [])
    assert plan.spec.parallelism.data == 2 and plan.spec.model.precision == "bf16"
    one = shrink(SPECS["gpt-1.3b-4gpu"], gpus=1)  # a GPU rather than DP 2 on CPU ranks
    assert (one.device, one.ranks) == ("gpu", 1)
    assert one.downgraded == ["parallelism.data: 4 → 1 (DP 2 would need 2 ranks, more than "
                              "1 local GPUs)"]  # fmt: skip
    llama = shrink(SPECS["llama-8b-32gpu"], gpus=4)  # TP 4 × PP 2 needs 8
    assert (llama.device, llama.ranks) == ("cpu", 8)
    assert shrink(SPECS["tiny-cpu"], gpus=8).device == "cpu"  # the spec trains on CPU


def test_local_gpus_follow_cuda_visible_devices() -> None:
    assert local_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3


def _line(event: str, **fields: object) -> str:
    return json.dumps({"ts": 1.0, "event": event, **fields})  # as the trainer writes it


def _log(plan_features: dict, steps: dict[int, float], saved: list[int], loaded: list[int]) -> str:
    lines = ["some warning on stderr", _line("train_start", features=plan_features)]
    lines += [_line("checkpoint_loaded", step=s) for s in loaded]
    lines += [_line("step", step=s, loss=v) for s, v in steps.items()]
    lines += [_line("checkpoint_saved", step=s) for s in saved]
    return "\n".join(lines)


def test_phase_problems_read_features_steps_and_checkpoints() -> None:
    plan = shrink(_llama_vpp())
    train, resume = PHASES
    want = {"sequence_parallel": True, "recompute": "full", "model_chunks": 3}
    good = events(_log(want, {1: 8.3, 2: 8.1}, [2], []))
    assert phase_problems(plan, train, good) == []
    assert phase_problems(plan, resume, events(_log(want, {3: 8.0}, [3], [2]))) == []
    plain = want | {"model_chunks": 1}
    bad = events(_log(plain, {1: float("nan")}, [], []))
    assert phase_problems(plan, train, bad) == [
        f"trained with features {plain}, the spec asks for {want}",
        "step 1: loss nan",
        "no step 2 logged",
        "no checkpoint saved at step 2",
    ]
    fresh = events(_log(want, {3: 8.0}, [3], []))
    assert phase_problems(plan, resume, fresh) == ["expected to resume from step 2, loaded []"]


def test_error_tail_starts_at_the_last_traceback() -> None:
    log = "\n".join(
        ["noise"] * 50
        + ["[rank1]: Traceback (most recent call last):", "[rank1]:   File x", "[rank1]: E: boom"]
    )
    assert error_tail(log) == [
        "[rank1]: Traceback (most recent call last):",
        "[rank1]:   File x",
        "[rank1]: E: boom",
    ]
    assert error_tail("\n".join(str(i) for i in range(100)), max_lines=3) == ["97", "98", "99"]
    long = "Traceback (most recent call last):\n" + "\n".join(f"f{i}" for i in range(10))
    assert error_tail(long, max_lines=5) == [
        "Traceback (most recent call last):",
        "… 7 lines …",
        "f7",
        "f8",
        "f9",
    ]


def test_an_evaluating_blend_smokes_its_split_and_evaluates_every_step() -> None:
    data = SPECS["llama-8b-32gpu"].model_dump()
    data["data"] = {"blend": [{"prefix": "/d/a", "weight": 2}, {"prefix": "/d/b", "weight": 1}],
                    "split": "98,2"}  # fmt: skip
    data["training"].update(eval_interval=1000, eval_iters=50)
    small = shrink(RunSpec.model_validate(data), gpus=0).spec
    assert small.data.blend is None and small.data.prefix is None  # the demo corpus
    assert small.data.split == "98,2"
    assert (small.training.eval_interval, small.training.eval_iters) == (1, 1)
    plain = shrink(SPECS["llama-8b-32gpu"], gpus=0).spec
    assert (plain.training.eval_interval, plain.data.split) == (0, None)
