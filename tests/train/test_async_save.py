"""Asynchronous checkpoint saves (`checkpoint.async_save`), two CPU ranks (gloo, DP 2).

* `sync` / `async`: the same 8 steps, a save every 2, one run per mode: same losses, same
  checkpoint files byte for byte at every save;
* `async_resumed`: resumes the async run's step-4 checkpoint and trains to 8: bit-for-bit the
  async run's losses;
* `crash`: rank 1 dies at the start of step 5, while the save of step 4 is in flight: that
  checkpoint never looks complete, step 2's does;
* `signal`: SIGTERM after step 2: exit 75 and every save up to the stop step published.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from train_helpers import spec_dict

from contracts import checkpoints, exitcodes
from worker.local_launch import LocalRun

pytestmark = pytest.mark.timeout(600)


def _spec(name: str, async_save: bool, faults: list[dict] | None = None) -> dict:
    spec = spec_dict(name, tp=1, pp=1, dp=2, steps=8, interval=2, faults=faults)
    spec["checkpoint"]["async_save"] = async_save
    return spec


@pytest.fixture(scope="module")
def runs(run_train, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("async")
    out: dict = {"root": root}
    for name, async_save in (("sync", False), ("async", True)):
        run = run_train(_spec(name, async_save), root / name)
        out[f"{name}_codes"] = run.wait(240)
        out[name] = run
    resumed = run_train(_spec("async", True), root / "async", ["--resume-step", "4"])
    out["async_resumed_codes"] = resumed.wait(240)
    out["async_resumed"] = resumed

    crash = [{"kind": "crash", "step": 5, "rank": 1}]
    run = run_train(_spec("crash", True, crash), root / "crash")
    out["crash_codes"] = run.wait(240)
    out["crash"] = run

    run = run_train(_spec("signal", True), root / "signal")

    def stop_after_step_2(r: LocalRun) -> None:
        if "signalled" not in out and 2 in r.losses():
            r.signal(signal.SIGTERM)
            out["signalled"] = True

    out["signal_codes"] = run.wait(240, on_poll=stop_after_step_2)
    out["signal"] = run
    return out


def test_async_save_trains_and_writes_like_sync(runs) -> None:
    assert runs["sync_codes"] == runs["async_codes"] == [0, 0]
    assert runs["async"].losses() == runs["sync"].losses()
    saved = [e for e in runs["async"].events() if e["event"] == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [2, 4, 6, 8]
    assert all(e["async_save"] and e["stall_seconds"] <= e["seconds"] for e in saved)
    differ, results_files = {}, []
    for step in (2, 4, 6, 8):
        sync_dir = checkpoints.step_dir(runs["root"] / "sync", step)
        async_dir = checkpoints.step_dir(runs["root"] / "async", step)
        data = sorted(p.name for p in sync_dir.glob("*.distcp"))
        assert data and data == sorted(p.name for p in async_dir.glob("*.distcp"))
        names = [n for n in data if (sync_dir / n).read_bytes() != (async_dir / n).read_bytes()]
        if names:
            differ[step] = names
        results_files += list(async_dir.glob(checkpoints.WRITE_RESULTS_PREFIX + "*"))
    assert differ == {}
    assert results_files == []  # the finalize removed them before the publish


def test_resume_from_an_async_checkpoint_is_exact(runs) -> None:
    assert runs["async_resumed_codes"] == [0, 0]
    got = runs["async_resumed"].losses()
    assert sorted(got) == [5, 6, 7, 8]
    assert got == {s: runs["async"].losses()[s] for s in got}


def test_a_rank_killed_mid_save_leaves_no_complete_checkpoint(runs) -> None:
    assert exitcodes.INJECTED_CRASH in runs["crash_codes"]
    root: Path = runs["root"] / "crash"
    assert [c.step for c in checkpoints.list_checkpoints(root)] == [2]
    assert not checkpoints.step_dir(root, 4).exists()
    assert checkpoints.read_latest(root) == 2
    assert not (checkpoints.tmp_dir(root, 4) / checkpoints.META_NAME).exists()


def test_a_stop_signal_publishes_the_save_in_flight(runs) -> None:
    assert runs["signal_codes"] == [exitcodes.REQUEUE] * 2
    last = max(runs["signal"].losses())
    assert 2 < last < 8
    listed = [c.step for c in checkpoints.list_checkpoints(runs["root"] / "signal")]
    assert listed == [s for s in (2, 4, 6) if s < last] + [last]
    assert checkpoints.read_latest(runs["root"] / "signal") == last
