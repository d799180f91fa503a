"""The interleaved (virtual) pipeline trains the same model as the plain layout, and its
checkpoints resume exactly, onto the same layout and onto one chunk per rank at another DP size
(Llama options: RMSNorm, SwiGLU, RoPE, GQA; CPU ranks).

One scenario, shared by the tests below (four runs of 1–4 ranks):
* `plain`: TP1×PP1, 4 steps, the reference;
* `vpp`: PP2×DP2 with 2 model chunks per rank, a checkpoint every 2 steps;
* `vpp_resume`: the same spec, from `vpp`'s step-2 checkpoint;
* `pp_dp1`: PP2×DP1 without chunks, from that checkpoint too.
"""

from __future__ import annotations

import pytest
from train_helpers import spec_dict

from worker.local_launch import LocalRun

pytestmark = pytest.mark.timeout(400)

STEPS = 4


def _llama(name: str, pp: int = 1, dp: int = 1, vp: int | None = None) -> dict:
    spec = spec_dict(name, tp=1, pp=pp, dp=dp, steps=STEPS, interval=2)
    spec["model"].update(
        normalization="RMSNorm", activation="swiglu", position_embedding="rope", num_query_groups=2
    )
    spec["parallelism"]["virtual_pipeline"] = vp
    return spec


def _features(run: LocalRun) -> dict:
    (start,) = [e for e in run.events() if e["event"] == "train_start"]
    return start["features"]


def _same_losses(got: LocalRun, ref: LocalRun, steps: list[int]) -> None:
    a, b = got.losses(), ref.losses()
    assert sorted(a) == steps
    assert [a[s] for s in steps] == pytest.approx([b[s] for s in steps], abs=1e-5)


@pytest.fixture(scope="module")
def scenario(run_train, tmp_path_factory) -> dict[str, LocalRun]:
    root = tmp_path_factory.mktemp("interleaved")
    out: dict[str, LocalRun] = {}

    def run(name: str, spec: dict, folder: str, extra: list[str] | None = None) -> None:
        started = run_train(spec, root / folder, extra)
        ranks = spec["resources"]["gpus_per_node"]
        assert started.wait(300) == [0] * ranks, (name, started.logs[0].read_text()[-3000:])
        out[name] = started

    run("plain", _llama("plain"), "plain")
    run("vpp", _llama("vpp", pp=2, dp=2, vp=2), "vpp")
    run("vpp_resume", _llama("vpp", pp=2, dp=2, vp=2), "vpp", ["--resume-step", "2"])
    run("pp_dp1", _llama("pp-dp1", pp=2), "vpp", ["--resume-step", "2"])
    return out


def test_interleaved_pipeline_matches_the_plain_layout(scenario) -> None:
    assert _features(scenario["vpp"])["model_chunks"] == 2
    _same_losses(scenario["vpp"], scenario["plain"], list(range(1, STEPS + 1)))


def test_interleaved_checkpoint_resumes_exactly_and_onto_one_chunk_per_rank(scenario) -> None:
    for name in ("vpp_resume", "pp_dp1"):
        loaded = [e for e in scenario[name].events() if e["event"] == "checkpoint_loaded"]
        assert [e["step"] for e in loaded] == [2], name
        _same_losses(scenario[name], scenario["vpp"], [3, 4])
    assert _features(scenario["pp_dp1"])["model_chunks"] == 1
