"""Checkpoint directory layout, metadata and listing — torch-free (docs/contracts.md).

The supervisor imports this module to find "last good" checkpoints, so it must not import
torch or megatron. The save/load of tensors lives in `megatron_runs.dist_ckpt`.

Layout: `<dir>/iter_0000100/` published by renaming `<dir>/.tmp_iter_0000100/` after its
`nightwatch.json` (sizes of every file) is written and checked; `<dir>/latest` (step as text)
is replaced last. Each step is durable before the next one makes it visible: the metadata
file and the directory are fsynced before the rename, the parent after it and after `latest`.
A directory is a candidate only when its metadata says complete and every listed file still
has its recorded size, so a truncated or half-copied checkpoint is skipped.
`<dir>/pins/iter_0000100` (empty) keeps step 100 from retention: the watchdog pins a rollback's
checkpoint before it stops the job that would otherwise prune it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

META_NAME = "nightwatch.json"
LATEST_NAME = "latest"
_PREFIX = "iter_"
_TMP_PREFIX = ".tmp_iter_"
PINS_NAME = "pins"
COMPILE_CACHE_NAME = ".compile_cache"
#: A rank's write results in a save's temp dir (then the rank and `.pkl`): the save's finalize
#: reads and removes it before the publish.
WRITE_RESULTS_PREFIX = ".write-results-rank"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    consumed_samples: int
    loss: float | None
    saved_at: float
    layout: dict[str, int]
    complete: bool
    problem: str | None = None
    #: The losses of the good steps before it that the trainer's spike judgement keeps
    #: (`megatron_runs.anomaly.LossTrend`), so a resumed attempt judges its first steps too.
    loss_trend: tuple[float, ...] = ()
    #: The trainer's newest evaluation at or before `step` (its step, validation loss): what
    #: the first evaluation after a resume from here is compared with (`eval_jump`).
    last_eval: tuple[int, float] | None = None


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:07d}"


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{_TMP_PREFIX}{step:07d}"


def file_sizes(ckpt: Path) -> dict[str, int]:
    """Sizes of every file under a checkpoint directory except the metadata itself."""
    out = {}
    for p in sorted(Path(ckpt).rglob("*")):
        if p.is_file() and p.name != META_NAME:
            out[str(p.relative_to(ckpt))] = p.stat().st_size
    return out


def write_meta(
    ckpt: Path,
    step: int,
    consumed_samples: int,
    loss: float | None,
    layout: dict[str, int],
    saved_at: float | None = None,
    loss_trend: Sequence[float] = (),
    last_eval: tuple[int, float] | None = None,
) -> dict:
    meta = {
        "step": step,
        "consumed_samples": consumed_samples,
        "loss": loss if loss is None or loss == loss else None,
        "saved_at": time.time() if saved_at is None else saved_at,
        "layout": layout,
        "loss_trend": [float(x) for x in loss_trend],
        "last_eval": None if last_eval is None else [int(last_eval[0]), float(last_eval[1])],
        "complete": True,
        "files": file_sizes(ckpt),
    }
    _write_durably(Path(ckpt) / META_NAME, json.dumps(meta, indent=1, sort_keys=True))
    fsync_path(ckpt)
    return meta


def fsync_path(path: Path | str) -> None:
    """Flush a file's data, or a directory's entries (a rename inside it), to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically, the new content on disk before the rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def verify(ckpt: Path) -> str | None:
    """None when the checkpoint is complete, else what is wrong with it."""
    meta_path = Path(ckpt) / META_NAME
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        return f"{META_NAME} missing"
    except (OSError, json.JSONDecodeError) as exc:
        return f"{META_NAME} unreadable: {exc}"
    if meta.get("complete") is not True:
        return "not marked complete"
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return "no file list"
    for rel, size in files.items():
        p = Path(ckpt) / rel
        try:
            actual = p.stat().st_size
        except FileNotFoundError:
            return f"{rel} missing"
        if actual != size:
            return f"{rel} has {actual} bytes, expected {size}"
    return None


def read_info(ckpt: Path) -> CheckpointInfo | None:
    """Metadata of one `iter_*` directory (complete or not); None if it is not one."""
    ckpt = Path(ckpt)
    step = _step_of(ckpt.name)
    if step is None:
        return None
    problem = verify(ckpt)
    try:
        meta = json.loads((ckpt / META_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        meta = {}
    return CheckpointInfo(
        step=step,
        path=ckpt,
        consumed_samples=int(meta.get("consumed_samples", -1)),
        loss=meta.get("loss"),
        saved_at=float(meta.get("saved_at", 0.0)),
        layout=dict(meta.get("layout", {})),
        complete=problem is None,
        problem=problem,
        loss_trend=tuple(float(x) for x in meta.get("loss_trend", ())),
        last_eval=_last_eval(meta.get("last_eval")),
    )


def _last_eval(value: object) -> tuple[int, float] | None:
    """The recorded evaluation, if one of a finite loss was recorded (older metadata: none)."""
    if not isinstance(value, list) or len(value) != 2:
        return None
    step, loss = value
    if not isinstance(loss, int | float) or loss != loss or abs(loss) == float("inf"):
        return None
    return int(step), float(loss)


def list_checkpoints(root: Path | str, include_incomplete: bool = False) -> list[CheckpointInfo]:
    """Checkpoints under `root`, oldest first; only complete ones unless asked otherwise."""
    root = Path(root)
    if not root.is_dir():
        return []
    infos = [read_info(p) for p in root.iterdir() if p.is_dir()]
    found = [i for i in infos if i is not None and (include_incomplete or i.complete)]
    return sorted(found, key=lambda i: i.step)


def newest_complete(root: Path | str, at_most: int | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint (at or before `at_most` when given)."""
    cands = [c for c in list_checkpoints(root) if at_most is None or c.step <= at_most]
    return cands[-1] if cands else None


def choose(root: Path | str, resume_step: int | None) -> CheckpointInfo | None:
    """The checkpoint to resume from: the newest complete one, or with `resume_step` the
    newest complete one at or before it (None: start from scratch).

    `resume_step` is a bound, not only a name: a rollback asks for the newest checkpoint
    before a fault's onset, and the attempt it stopped may have pruned that very one
    (retention) before it died; any older one is also from before the onset.
    `resume_step == 0` means start from scratch (a rollback past every checkpoint).
    """
    if resume_step == 0:
        return None
    return newest_complete(root, at_most=resume_step)


def read_latest(root: Path | str) -> int | None:
    try:
        return int((Path(root) / LATEST_NAME).read_text().strip())
    except (OSError, ValueError):
        return None


def publish(root: Path, step: int) -> Path:
    """Rename the verified temp dir into place, then replace `latest` (written last).

    The temp dir's files must already be on disk (`write_meta` syncs the metadata and the
    directory); the renames are synced here."""
    root = Path(root)
    src, dst = tmp_dir(root, step), step_dir(root, step)
    problem = verify(src)
    if problem:
        raise RuntimeError(f"refusing to publish checkpoint {src}: {problem}")
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(src, dst)
    fsync_path(root)
    _write_durably(root / LATEST_NAME, str(step))
    fsync_path(root)
    return dst


def compile_cache_dir(root: Path | str) -> Path:
    """The run's compiled-kernel cache (TorchInductor, Triton), shared by its attempts: a
    restart reuses the kernels instead of compiling them again. Retention never touches it."""
    return Path(root) / COMPILE_CACHE_NAME


def pin(root: Path | str, step: int) -> None:
    """Keep `step` from retention (idempotent): the job being stopped saves and prunes on
    until it dies, and a rollback's target must still be there for the next attempt."""
    path = _pin_path(root, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def pinned(root: Path | str) -> set[int]:
    pins = Path(root) / PINS_NAME
    if not pins.is_dir():
        return set()
    steps = (_step_of(p.name) for p in pins.iterdir())
    return {step for step in steps if step is not None}


def unpin_below(root: Path | str, step: int | None = None) -> None:
    """Drop pins older than `step` (all without one): an attempt that resumed at `step` has
    made them history, and a finished run needs none."""
    for old in pinned(root):
        if step is None or old < step:
            _pin_path(root, old).unlink(missing_ok=True)


def _pin_path(root: Path | str, step: int) -> Path:
    return step_dir(Path(root) / PINS_NAME, step)


def _step_of(name: str) -> int | None:
    """The step an `iter_*` name stands for; None for any other name."""
    if not name.startswith(_PREFIX):
        return None
    try:
        return int(name[len(_PREFIX) :])
    except ValueError:
        return None


def retain(
    root: Path | str,
    keep_last: int,
    protect: set[int] | None = None,
    keep_seconds: float = 0.0,
    stale_through: int | None = None,
) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, those saved within
    `keep_seconds` of the newest, the `protect`ed and the pinned ones; return what was removed.

    The time window is what a rollback needs: the newest checkpoint from before a fault the
    watchdog saw seconds later. With fast steps `keep_last` alone rotates it out first (10-step
    saves at 0.06 s a step keep 1.8 s of history with `keep_last` 3). Incomplete directories
    older than the newest complete one and stale temp dirs go too.

    `stale_through`: the step of the save this retention follows, for retention on a thread
    beside the next save (a process saves at rising steps). Nothing above that step is
    touched: neither the next save's temp dir, nor the checkpoint it may publish meanwhile
    (or replace, after a rollback) between this function's two listings.
    """
    root = Path(root)
    complete = list_checkpoints(root)
    keep = {c.step for c in complete[-keep_last:]} | (protect or set())
    if complete:
        recent = complete[-1].saved_at - keep_seconds
        keep |= {c.step for c in complete if c.saved_at >= recent}
    newest = complete[-1].step if complete else -1
    removed = []
    for info in list_checkpoints(root, include_incomplete=True):
        if info.step in keep or (not info.complete and info.step > newest):
            continue
        if stale_through is not None and info.step > stale_through:
            continue
        if _pin_path(root, info.step).exists():  # looked up last: a pin may have just landed
            continue
        shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info.path)
    for stale in root.glob(f"{_TMP_PREFIX}*"):
        step = _step_of(stale.name[len(_TMP_PREFIX) - len(_PREFIX) :])
        if stale_through is not None and step is not None and step > stale_through:
            continue
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(stale)
    return removed


#: The newest save's timing, kept by the trainer beside the checkpoints (`.health/`, which
#: retention never touches): the supervisor sizes the next attempt's stop-signal lead by it.
SAVE_TIMING_PATH = Path(".health") / "save_timing.json"


@dataclass(frozen=True)
class SaveTiming:
    """How long this run's newest published save took, and its steps."""

    step: int
    #: From the save's start until it was published (what a stop signal must wait for).
    seconds: float
    #: How long the training loop stood still for it.
    stall_seconds: float
    #: The wall time of the step before it (a signal lands mid-step: that step ends first).
    step_seconds: float
    async_save: bool = False
    #: The save interval the trainer goes on with (`checkpoint.interval_auto` adapts it).
    interval_steps: int = 0


def write_save_timing(root: Path | str, timing: SaveTiming) -> None:
    """Replace the timing file atomically (a reader sees the old or the new one)."""
    path = Path(root) / SAVE_TIMING_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(timing.__dict__))
    os.replace(tmp, path)


def read_save_timing(root: Path | str) -> SaveTiming | None:
    """The newest save's timing (None: no save measured yet, or an unreadable file)."""
    try:
        d = json.loads((Path(root) / SAVE_TIMING_PATH).read_text())
        return SaveTiming(
            step=int(d["step"]),
            seconds=float(d["seconds"]),
            stall_seconds=float(d["stall_seconds"]),
            step_seconds=float(d["step_seconds"]),
            async_save=bool(d.get("async_save", False)),
            interval_steps=int(d.get("interval_steps", 0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def young_daly_steps(save_cost_s: float, mtbf_s: float, step_s: float, lo: int, hi: int) -> int:
    """Steps between saves that minimise the expected lost time: Young's sqrt(2 · C · M)
    seconds of training (C the loop's cost per save, M the mean time between failures), in
    steps of `step_s`, within [lo, hi] (pure)."""
    if step_s <= 0 or mtbf_s <= 0:
        return hi
    steps = math.sqrt(2.0 * max(save_cost_s, 0.0) * mtbf_s) / step_s
    return int(min(hi, max(lo, round(steps))))
