"""Checkpoint metadata, verification, publish and retention — torch-free by contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contracts import checkpoints as ck

LAYOUT = {"tensor": 2, "pipeline": 2, "data": 1}


def _fake_ckpt(root: Path, step: int, publish: bool = True) -> Path:
    tmp = ck.tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"x" * (100 + step))
    (tmp / "common.pt").write_bytes(b"y" * 10)
    ck.write_meta(tmp, step, consumed_samples=8 * step, loss=2.5, layout=LAYOUT)
    return ck.publish(root, step) if publish else tmp


def test_importable_without_torch() -> None:
    code = "import sys, contracts.checkpoints; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_publish_writes_meta_and_latest_last(tmp_path: Path) -> None:
    path = _fake_ckpt(tmp_path, 3)
    meta = json.loads((path / ck.META_NAME).read_text())
    assert meta["step"] == 3 and meta["consumed_samples"] == 24 and meta["complete"] is True
    assert meta["layout"] == LAYOUT and meta["files"] == {"__0_0.distcp": 103, "common.pt": 10}
    assert ck.read_latest(tmp_path) == 3
    assert not ck.tmp_dir(tmp_path, 3).exists()
    [info] = ck.list_checkpoints(tmp_path)
    assert (info.step, info.consumed_samples, info.loss, info.complete) == (3, 24, 2.5, True)


def test_truncated_newest_is_skipped_for_previous(tmp_path: Path) -> None:
    _fake_ckpt(tmp_path, 2)
    newest = _fake_ckpt(tmp_path, 4)
    with (newest / "__0_0.distcp").open("r+b") as f:
        f.truncate(10)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [2]
    assert ck.newest_complete(tmp_path).step == 2
    bad = ck.read_info(newest)
    assert not bad.complete and "__0_0.distcp has 10 bytes" in bad.problem
    assert ck.read_latest(tmp_path) == 4  # the marker alone is not trusted


def test_missing_or_incomplete_meta_is_not_a_candidate(tmp_path: Path) -> None:
    _fake_ckpt(tmp_path, 1)
    partial = ck.step_dir(tmp_path, 5)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"z")
    assert ck.read_info(partial).problem == f"{ck.META_NAME} missing"
    other = _fake_ckpt(tmp_path, 6)
    meta = json.loads((other / ck.META_NAME).read_text())
    (other / ck.META_NAME).write_text(json.dumps({**meta, "complete": False}))
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [1]
    assert ck.newest_complete(tmp_path, at_most=0) is None


def test_publish_refuses_unverified_temp_dir(tmp_path: Path) -> None:
    tmp = _fake_ckpt(tmp_path, 7, publish=False)
    (tmp / "common.pt").write_bytes(b"")
    try:
        ck.publish(tmp_path, 7)
    except RuntimeError as exc:
        assert "common.pt" in str(exc)
    else:
        raise AssertionError("publish accepted a checkpoint whose file shrank")
    assert ck.read_latest(tmp_path) is None


def test_retention_keeps_last_complete_and_drops_stale(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _fake_ckpt(tmp_path, step)
    ck.tmp_dir(tmp_path, 9).mkdir()
    removed = ck.retain(tmp_path, keep_last=2)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [3, 4]
    assert ck.tmp_dir(tmp_path, 9) in removed


def test_retention_on_a_thread_spares_the_next_saves_temp_dir(tmp_path: Path) -> None:
    """The trainer's retention after publishing step 4 runs while the save of step 6 writes:
    it removes temp dirs up to step 4 (a crashed attempt's), not the one being written."""
    for step in (2, 4):
        _fake_ckpt(tmp_path, step)
    for step in (3, 4, 6):
        ck.tmp_dir(tmp_path, step).mkdir()
    removed = ck.retain(tmp_path, keep_last=2, stale_through=4)
    assert set(removed) == {ck.tmp_dir(tmp_path, 3), ck.tmp_dir(tmp_path, 4)}
    assert ck.tmp_dir(tmp_path, 6).is_dir()


def test_retention_on_a_thread_spares_what_the_next_save_replaces(tmp_path: Path) -> None:
    """After a rollback to 20, the attempt publishes 20 and its retention runs while the save
    of 30 replaces the older attempt's 30 (removed, then renamed into place): half removed,
    30 reads as incomplete and older than the newest (40), which retention would delete too,
    racing the publish. With `stale_through` it leaves everything above 20 alone."""
    for step in (10, 20, 30, 40):
        _fake_ckpt(tmp_path, step)
    (ck.step_dir(tmp_path, 30) / ck.META_NAME).unlink()
    ck.retain(tmp_path, keep_last=1, stale_through=20)
    assert ck.step_dir(tmp_path, 30).is_dir()
    assert not ck.step_dir(tmp_path, 10).exists() and not ck.step_dir(tmp_path, 20).exists()
    ck.retain(tmp_path, keep_last=1)
    assert not ck.step_dir(tmp_path, 30).exists()


def test_retention_keeps_a_time_window_behind_the_newest(tmp_path: Path) -> None:
    """Saves 0.6 s apart: `keep_last` 3 alone prunes the last checkpoint before a loss spike
    by the time the spike is seen, and the rollback goes back to the checkpoint the attempt
    resumed from (1,968 steps in one soak)."""
    for step in range(10, 110, 10):
        tmp = ck.tmp_dir(tmp_path, step)
        tmp.mkdir(parents=True)
        (tmp / "__0_0.distcp").write_bytes(b"x")
        ck.write_meta(tmp, step, 8 * step, 2.5, LAYOUT, saved_at=1000.0 + 0.06 * step)
        ck.publish(tmp_path, step)
        ck.retain(tmp_path, keep_last=3, keep_seconds=2.0)
    # saved at 1000.6 ... 1006.0: within 2 s of the newest are 1004.2 (step 70) and later
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [70, 80, 90, 100]
    ck.retain(tmp_path, keep_last=3)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [80, 90, 100]


def test_list_of_missing_dir_is_empty(tmp_path: Path) -> None:
    assert ck.list_checkpoints(tmp_path / "nope") == []


def test_resumed_from_survives_retention_and_resume_step_is_a_bound(tmp_path: Path) -> None:
    """An attempt resumed from 10 keeps it while it saves on (the watchdog may be rolling
    back to it); a resume step whose checkpoint was pruned anyway gets the newest before it,
    which is also from before the fault's onset."""
    for step in (10, 20, 30, 40):
        _fake_ckpt(tmp_path, step)
    ck.retain(tmp_path, keep_last=2, protect={10})
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [10, 30, 40]
    assert ck.choose(tmp_path, None).step == 40  # type: ignore[union-attr]
    assert ck.choose(tmp_path, 30).step == 30  # type: ignore[union-attr]
    assert ck.choose(tmp_path, 25).step == 10  # type: ignore[union-attr]
    assert ck.choose(tmp_path, 5) is None
    assert ck.choose(tmp_path, 0) is None


def test_a_pinned_checkpoint_survives_retention_until_an_attempt_resumes_past_it(
    tmp_path: Path,
) -> None:
    """The watchdog pins a rollback's checkpoint before it stops the job, which saves and
    prunes on until SLURM kills it; an attempt that resumed at a newer step drops the pin."""
    for step in (10, 20, 30):
        _fake_ckpt(tmp_path, step)
    ck.pin(tmp_path, 20)
    ck.pin(tmp_path, 20)  # idempotent: the actuator may redo an action after a crash
    for step in (40, 50, 60):
        _fake_ckpt(tmp_path, step)
        ck.retain(tmp_path, keep_last=2)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [20, 50, 60]
    assert ck.choose(tmp_path, 20).step == 20  # type: ignore[union-attr]
    ck.unpin_below(tmp_path, 20)
    assert ck.pinned(tmp_path) == {20}
    ck.unpin_below(tmp_path, 50)
    assert ck.pinned(tmp_path) == set()
    ck.retain(tmp_path, keep_last=2)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [50, 60]


def test_the_compile_cache_lives_in_the_run_folder_and_survives_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_runs import train

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    train.use_run_compile_cache(tmp_path)
    cache = ck.compile_cache_dir(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(cache / "triton")
    (cache / "triton").mkdir(parents=True)
    for step in (1, 2, 3):
        _fake_ckpt(tmp_path, step)
    ck.retain(tmp_path, keep_last=1)
    assert (cache / "triton").is_dir()


def test_the_last_evaluation_is_recorded_and_read_back(tmp_path: Path) -> None:
    for step, last_eval in ((4, (4, 5.5)), (8, None), (12, (10, float("nan")))):
        tmp = ck.tmp_dir(tmp_path, step)
        tmp.mkdir(parents=True)
        (tmp / "common.pt").write_bytes(b"y" * 10)
        ck.write_meta(tmp, step, 8 * step, 2.5, LAYOUT, last_eval=last_eval)
        ck.publish(tmp_path, step)
    found = {c.step: c.last_eval for c in ck.list_checkpoints(tmp_path)}
    assert found == {4: (4, 5.5), 8: None, 12: None}  # a non-finite loss compares with nothing
    meta = json.loads((ck.step_dir(tmp_path, 4) / ck.META_NAME).read_text())
    assert meta["last_eval"] == [4, 5.5]
