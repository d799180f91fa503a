"""Run a smoke plan on this host: the ranks of `python -m megatron_runs.train` started by
`worker.local_launch`, in a temporary folder, under one deadline for all phases.

The verdict names the first rank that failed and ends with its traceback (the others, killed
or failing in a collective after it, only repeat the symptom).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from contracts.paths import nightwatch_home
from supervisor.smoke.plan import PHASES, SmokePlan, error_tail, phase_problems
from worker.local_launch import LocalRun, launch

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class SmokeResult:
    ok: bool
    device: str
    ranks: int
    seconds: float
    downgraded: list[str]
    phase: str | None = None
    """The phase that failed (`prepare` the demo corpus, `train`, `resume`); None if none."""
    error: str | None = None
    rank: int | None = None
    tail: list[str] = field(default_factory=list)
    """The failed rank's last log lines, from its traceback on."""
    log_dir: str | None = None
    """Where the failed phase's rank logs were kept (None on success: the folder is gone)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def local_gpus(env: dict[str, str] | None = None) -> int:
    """GPUs this process could use, without importing torch: CUDA_VISIBLE_DEVICES when set,
    else what `nvidia-smi -L` lists (none without the tool)."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines())


class SmokeBusy(Exception):
    """Another smoke check holds this host (`one_at_a_time`)."""


@contextmanager
def one_at_a_time(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path` for one smoke check, across threads and
    processes (the API's workers); raise SmokeBusy at once if another holds it."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise SmokeBusy(f"a smoke check is already running on this host ({lock_path})") from exc
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_smoke(
    plan: SmokePlan,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    keep_failed_logs: bool = True,
    home: Path | None = None,
    entry: tuple[str, ...] = ("-m", "megatron_runs.train"),
) -> SmokeResult:
    """Every phase of `plan`, one after the other, in a fresh temporary folder (checkpoints
    and logs) that is removed afterwards; a failed phase's logs are kept unless
    `keep_failed_logs` is false. The demo corpus is prepared (once per `home`, default
    NIGHTWATCH_HOME) before the clock starts."""
    from megatron_runs.data_prep import prepare

    home = home or nightwatch_home()
    try:
        prepare(None, home / "data", plan.spec.model.vocab_size)
    except (ImportError, OSError, ValueError) as exc:  # no training packages, no disk space
        return SmokeResult(ok=False, device=plan.device, ranks=plan.ranks, seconds=0.0,
                           downgraded=plan.downgraded, phase="prepare",
                           error=f"preparing the demo corpus failed: {exc!r}")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix=f"nightwatch-smoke-{plan.spec.name}-"))
    result = None
    try:
        result = _run_phases(plan, work, home, timeout_s, entry)
    finally:
        if result is not None and result.log_dir is not None and keep_failed_logs:
            shutil.rmtree(work / "checkpoints", ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return result if keep_failed_logs else replace(result, log_dir=None)


def _run_phases(
    plan: SmokePlan, work: Path, home: Path, timeout_s: float, entry: tuple[str, ...]
) -> SmokeResult:
    started = time.monotonic()
    deadline = started + timeout_s
    env = {"NIGHTWATCH_HOME": str(home), "PYTHONWARNINGS": "ignore"}
    if plan.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    spec_path = work / "spec.json"
    spec_path.write_text(plan.spec.to_json())
    base = {"device": plan.device, "ranks": plan.ranks, "downgraded": plan.downgraded}
    for phase in PHASES:
        args = ["--spec", str(spec_path), "--checkpoint-dir", str(work / "checkpoints"),
                "--run-id", "smoke", *phase.extra_args]  # fmt: skip
        logs = work / f"logs-{phase.name}"
        run = launch(args, plan.ranks, logs, env=env, entry=entry)
        failure = _wait(run, deadline - time.monotonic(), timeout_s)
        if failure is None:
            problems = phase_problems(plan, phase, run.events())
            failure = ("; ".join(problems), 0, []) if problems else None
        if failure is not None:
            error, rank, tail = failure
            return SmokeResult(ok=False, **base, seconds=round(time.monotonic() - started, 1),
                               phase=phase.name, error=error, rank=rank, tail=tail,
                               log_dir=str(logs))  # fmt: skip
    return SmokeResult(ok=True, **base, seconds=round(time.monotonic() - started, 1))


def _wait(run: LocalRun, left_s: float, budget_s: float) -> tuple[str, int, list[str]] | None:
    """None when every rank exited 0 within `left_s`; else (error line, rank, its log's
    tail), naming the first rank seen to fail (the local launcher stops the rest 2 s later)."""
    first: list[int] = []

    def note_first_failure(r: LocalRun) -> None:
        if not first:
            first.extend(i for i, c in enumerate(r.poll()) if c not in (None, 0))

    try:
        codes = run.wait(max(left_s, 1.0), on_poll=note_first_failure)
    except TimeoutError:
        tail = error_tail(run.logs[0].read_text(errors="replace"))
        return f"timed out after {budget_s:g} s (rank 0's log ends below)", 0, tail
    except BaseException:  # Ctrl-C: the ranks run in their own sessions and would train on
        run.kill()
        raise
    if all(c == 0 for c in codes):
        return None
    rank = first[0] if first else next(i for i, c in enumerate(codes) if c != 0)
    tail = error_tail(run.logs[rank].read_text(errors="replace"))
    last = next((line for line in reversed(tail) if line.strip()), "")
    return f"rank {rank} exited {codes[rank]}: {last}", rank, tail
