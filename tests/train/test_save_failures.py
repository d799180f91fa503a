"""What a failed checkpoint save does to the ranks, on real gloo process groups.

A storage failure is reported and training goes on, every rank in step. A peer that dies
mid-save breaks the process group: the save must not swallow that, or the surviving ranks go
on from different collectives and hang where they should have exited.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
from train_helpers import spec_dict

from contracts.spec import RunSpec

SPEC = RunSpec.model_validate(spec_dict("save-failures", tp=1, pp=1, dp=2))


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, all_ranks: bool = False, **fields: Any) -> None:
        self.seen.append((event, fields))


#: The gauge that says the loop waits on a save (`contracts.metric_names`).
SAVING = "nightwatch_train_save_started_timestamp_seconds"


def _rank(rank: int, store: str, root: str, mode: str, answers: Any) -> None:
    """One rank of a 2-rank gloo job that saves at step 10 (megatron's writer stubbed: rank 1
    `dies` in it, it writes nothing (`empty`), or it fails on every rank as megatron's does
    when a writer process failed, `write_failed`). It imports the training loop here, in the
    spawned process: megatron stays out of pytest's. It also answers what its metrics said of
    the save while the writer ran and after."""
    from megatron_runs import setup  # first: its CPU stand-ins must precede megatron's import

    torch = setup.torch
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_runs import dist_ckpt, saver
    from megatron_runs.metrics import TrainMetrics

    metrics = TrainMetrics("r1", 1, f"n{rank}", run_level=rank == 0)
    labels = {"run_id": "r1", "attempt": "1", "node": f"n{rank}"}

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2
    )
    setup.ps.initialize_model_parallel(1, 1)

    def write(state: dict, path: str, *args: Any, **kwargs: Any) -> None:
        if mode == "dies" and rank == 1:
            os._exit(9)  # killed between the save's collectives
        answers.put((rank, "saving since", metrics.registry.get_sample_value(SAVING, labels)))
        torch.distributed.barrier()
        if mode == "write_failed":  # megatron broadcasts a writer's failure, then every rank raises
            worker = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672]")
            raise CheckpointException("write", {0: worker})

    dist_ckpt.dist_checkpointing.save = write
    dist_ckpt._state_dict = lambda *args, **kwargs: {}
    log = _Events()
    try:
        checkpoints = saver.Checkpointer(SPEC.checkpoint, Path(root), {}, None, metrics, None, log)
        checkpoints.save([], None, 10, 80, 5.0)
    except RuntimeError as exc:
        answers.put((rank, "raised", str(exc)[:200]))
        return
    answers.put((rank, "returned", [event for event, _ in log.seen]))
    answers.put((rank, "saved since", metrics.registry.get_sample_value(SAVING, labels)))
    torch.distributed.barrier()  # the group still works: both ranks went on in step
    answers.put((rank, "in step", None))


def _run_ranks(tmp_path: Path, mode: str) -> list[tuple[int, str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    root = tmp_path / "ckpt"
    procs = [
        ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), str(root), mode, answers))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            pytest.fail("a rank hung after the save")
    seen = []
    while not answers.empty():
        seen.append(answers.get())
    return sorted(seen, key=lambda a: (a[0], a[1]))


def test_a_peer_dying_mid_save_ends_the_survivor(tmp_path: Path) -> None:
    seen = [a for a in _run_ranks(tmp_path, "dies") if a[1] != "saving since"]
    assert [(rank, what) for rank, what, _ in seen] == [(0, "raised")]
    assert "closed" in seen[0][2].lower() or "reset" in seen[0][2].lower()


@pytest.mark.parametrize("mode", ["empty", "write_failed"])
def test_a_failed_save_is_reported_on_every_rank_and_both_go_on(tmp_path: Path, mode: str) -> None:
    """The stub writes nothing (rank 0 refuses to publish an empty checkpoint: verify fails),
    or megatron's writer failed (a full disk: every rank raises torch's CheckpointException)."""
    began = time.time()
    seen = _run_ranks(tmp_path, mode)
    assert [(rank, what) for rank, what, _ in seen] == [
        (0, "in step"),
        (0, "returned"),
        (0, "saved since"),
        (0, "saving since"),
        (1, "in step"),
        (1, "returned"),
        (1, "saved since"),
        (1, "saving since"),
    ]
    # every node's loop said it waited on a save while the writer ran, and no more after
    assert all(began <= v <= time.time() for _, what, v in seen if what == "saving since")
    assert all(v == 0 for _, what, v in seen if what == "saved since")
    assert all(events == ["checkpoint_failed"] for _, what, events in seen if what == "returned")
    assert not (tmp_path / "ckpt" / "latest").exists()
