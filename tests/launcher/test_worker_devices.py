"""The GPU check a node task makes before it imports or forks anything."""

from __future__ import annotations

import torch

from worker.devices import missing_gpus


def test_a_cpu_task_needs_no_gpu() -> None:
    assert missing_gpus(0, "n1") is None


def test_a_gpu_task_on_a_host_with_fewer_gpus_names_node_and_counts(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    found = torch.cuda.device_count()
    cause = missing_gpus(found + 1, "n7")
    assert cause == (
        f"no GPU: node n7 sees {found} of the {found + 1} GPUs this job needs "
        "(CUDA_VISIBLE_DEVICES='3')"
    )
    assert found == 0 or missing_gpus(found, "n7") is None
