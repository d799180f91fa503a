"""`async_save` on one CPU process: host buffers reused between saves, and a save published
only after its forked writer finished (one gloo rank)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from megatron_runs import async_save

REPO = Path(__file__).resolve().parents[2]


def test_host_buffers_are_reused_while_the_layout_holds() -> None:
    buffers = async_save.HostBuffers(pin=False)
    first = buffers.like([torch.ones(3, 4), torch.zeros(5, dtype=torch.bfloat16)])
    assert [(t.shape, t.dtype) for t in first] == [((3, 4), torch.float32), ((5,), torch.bfloat16)]
    again = buffers.like([torch.empty(3, 4), torch.empty(5, dtype=torch.bfloat16)])
    assert all(a is b for a, b in zip(first, again, strict=True))
    changed = buffers.like([torch.empty(3, 4), torch.empty(5)])  # a dtype changed
    assert changed[0] is not first[0] and changed[1].dtype == torch.float32


SCRIPT = r"""
import sys, time
from pathlib import Path
from megatron_runs import cpu_compat
cpu_compat.apply()
import torch
from megatron_runs import async_save

work = Path(sys.argv[1])
torch.distributed.init_process_group(
    "gloo", rank=0, world_size=1, init_method=f"file://{work / 'store'}"
)
gate, written, finalized = work / "gate", work / "written", work / "finalized"

def write(rank, buckets, results):
    while not gate.exists():
        time.sleep(0.01)
    written.write_text(buckets)

class Phases:
    def mark(self, phase):
        pass

def finalize():
    assert written.read_text() == "state", "finalized before the writer finished"
    finalized.write_text(str(int(finalized.exists()) + 1))
    return work / "published"

def run(finish):
    for p in (gate, written, finalized):
        p.unlink(missing_ok=True)
    pending = async_save.PendingSave(7, write, [0, "state", None], None, [], finalize, Phases())
    if finish == "wait":
        gate.touch()
        return pending.wait()
    polls = [pending.poll() for _ in range(5)]
    assert polls == [None] * 5 and not written.exists(), polls
    gate.touch()
    while (path := pending.poll()) is None:
        time.sleep(0.01)
    return path

for finish in ("poll", "wait"):
    assert run(finish) == work / "published"
    assert finalized.read_text() == "1"
print("ok")
"""


def test_a_save_is_finalized_once_and_only_after_its_writer_finished(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_an_async_checkpoint_holds_the_state_at_its_start_while_steps_change_it(
    tmp_path: Path,
) -> None:
    """Two gloo ranks (benchmarks/ckpt_save.py on CPU): each async save is followed by real
    optimizer updates while it is written, then loaded back; every parameter and Adam moment
    loaded equals the state when the save started, in both optimizer formats. Unlike the
    trainer's sync-against-async comparison (test_async_save.py), this needs no two runs to
    compute alike: the snapshot and the loaded state are compared within one process."""
    out = tmp_path / "ckpt_save.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/ckpt_save.py", "--size", "tiny", "--nproc", "2",
         "--repeats", "1", "--paths", "async", "--work", str(tmp_path / "work"),
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    repeats = json.loads(out.read_text())["repeats"]
    for fmt in ("fully_sharded_model_space", "fully_reshardable"):
        assert repeats[f"exact:{fmt}"] == [True]
        assert repeats[f"async:{fmt}"][0]["steps_meanwhile"] >= 1
