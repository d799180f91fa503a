"""`nightwatch validate --smoke` on CPU ranks: the tiny example with every model feature at once
passes (TP 2 × PP 2 × VPP 2, SP, Llama options, GQA, selective recompute, async saves), and a
spec the validator admits but megatron cannot build fails with exit 1 and the rank's error.
With stand-ins for the trainer: the first rank to fail is named, a hung run is killed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from supervisor.cli import app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _validate(spec: dict, tmp_path: Path, nw_home: Path, *flags: str):
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {"NIGHTWATCH_HOME": str(nw_home), "CUDA_VISIBLE_DEVICES": ""}
    return CliRunner().invoke(
        app, ["validate", str(path), "--smoke", *flags], env=env, catch_exceptions=False
    )


def test_the_tiny_example_with_every_feature_passes(tmp_path: Path, nw_home: Path) -> None:
    spec = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    spec["model"].update(normalization="RMSNorm", activation="swiglu", position_embedding="rope",
                         num_query_groups=2, untie_embeddings=True)  # fmt: skip
    spec["parallelism"].update(sequence_parallel=True, virtual_pipeline=2)
    spec["training"]["recompute"] = "selective"
    spec["checkpoint"]["async_save"] = True
    result = _validate(spec, tmp_path, nw_home, "--json")
    assert result.exit_code == 0, result.output
    smoke = json.loads(result.stdout)["smoke"]
    assert smoke["ok"] and (smoke["device"], smoke["ranks"]) == ("cpu", 4), smoke
    small = smoke["spec"]
    assert small["parallelism"] | {"data": 1} == spec["parallelism"] | {"data": 1}
    assert (small["model"]["num_layers"], small["model"]["num_query_groups"]) == (4, 2)
    assert smoke["seconds"] < 150 and smoke["log_dir"] is None


def test_a_layout_megatron_would_refuse_at_run_time_is_refused_at_validation(
    tmp_path: Path, nw_home: Path
) -> None:
    """TP 3 with heads and KV groups that divide, but a vocabulary (4096) that does not: the
    smoke check found megatron's vocab-parallel embedding asserting on it at run time, so the
    validator now names the field and the smoke check is not started."""
    spec = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    spec["model"].update(num_attention_heads=6, hidden_size=96)
    spec["parallelism"].update(tensor=3, pipeline=1)
    spec["resources"]["gpus_per_node"] = 3
    result = _validate(spec, tmp_path, nw_home)
    assert result.exit_code == 1, result.output
    assert "model.vocab_size: vocab_size 4096 is not divisible by tensor = 3" in result.stdout
    assert "smoke: skipped, the layout cannot run" in result.stdout


def _plan():
    from contracts.spec import RunSpec
    from supervisor.smoke.plan import shrink

    return shrink(RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml"))


# Stand-ins for the trainer (`worker.local_launch` runs `python <entry> <trainer flags>`):
# rank 1 fails, the others wait in what would be a collective; or every rank hangs.
_RANK1_FAILS = ("-c", "import os, time\nif os.environ['RANK'] == '1': raise RuntimeError('boom')\n"
                "time.sleep(120)")  # fmt: skip
_HANGS = ("-c", "import time; print('stuck in init'); time.sleep(120)")


def test_the_first_rank_to_fail_is_named_not_the_ones_stopped_after_it(
    nw_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from supervisor.smoke.run import run_smoke

    monkeypatch.setenv("NIGHTWATCH_HOME", str(nw_home))
    result = run_smoke(_plan(), timeout_s=60, keep_failed_logs=False, entry=_RANK1_FAILS)
    assert (result.ok, result.phase, result.rank) == (False, "train", 1)
    assert result.error == "rank 1 exited 1: RuntimeError: boom", result.error
    assert result.tail[0] == "Traceback (most recent call last):" and result.log_dir is None


def test_a_hung_run_is_killed_at_the_timeout(nw_home: Path, monkeypatch) -> None:
    from supervisor.smoke.run import run_smoke

    monkeypatch.setenv("NIGHTWATCH_HOME", str(nw_home))
    result = run_smoke(_plan(), timeout_s=3, keep_failed_logs=False, entry=_HANGS)
    assert not result.ok and result.error.startswith("timed out after 3 s"), result.error
    assert result.tail == ["stuck in init"] and result.seconds < 10
