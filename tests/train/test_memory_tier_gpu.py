"""The memory tier on a GPU (run through the device machines; needs one CUDA device): the
slots are page-locked on a thread, the copy runs on a side stream while training goes on and
the optimizer's update waits for it. A rank restarted from the tier must start from the very
parameters the disk checkpoint holds: its first loss after the resume equals (==) the first
loss of a resume from disk. On CPU the tier is tested by test_memory_tier_cpu.py."""

from __future__ import annotations

import os

import pytest
import torch
from train_helpers import spec_dict

from contracts.restart import MEMORY_TIER_SLOTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _source(run) -> list[str]:
    return [e["source"] for e in run.events(0) if e["event"] == "checkpoint_loaded"]


def test_a_gpu_rank_resumes_from_the_tier_at_the_saved_parameters(run_train, tmp_path) -> None:
    spec = spec_dict("memory_tier_gpu", tp=1, pp=1, dp=1, steps=24, interval=4, layers=2)
    spec["model"]["precision"] = "bf16"
    spec["resources"]["device"] = "gpu"
    tier = [tuple(os.memfd_create(f"gpu-tier-{i}") for i in range(MEMORY_TIER_SLOTS))]
    try:
        full = run_train(spec, tmp_path / "ck", memory_tiers=tier)
        assert full.wait(300) == [0]
        # the first save pins the slots on a thread (not captured); a later one is
        saved = [e for e in full.events(0) if e["event"] == "checkpoint_saved"]
        assert not saved[0]["in_memory"]
        step = max(e["step"] for e in saved if e["in_memory"] and e["step"] < 24)
        memory = run_train(spec, tmp_path / "ck", ["--resume-step", str(step)], memory_tiers=tier)
        assert memory.wait(300) == [0]
    finally:
        for fd in tier[0]:
            os.close(fd)
    disk = run_train(spec, tmp_path / "ck", ["--resume-step", str(step)])
    assert disk.wait(300) == [0]
    assert _source(memory) == ["memory"] and _source(disk) == ["disk"]
    assert memory.losses()[step + 1] == disk.losses()[step + 1] == full.losses()[step + 1]
