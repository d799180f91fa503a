"""`local_launch.launch` forks its ranks from one launcher process (`worker.local_ranks`, a
node task's fork): each rank in its own session with its environment, log and rank name, exit
codes as Popen reports them, stop signals forwarded (one during the import too), a kill
reaching each rank's helpers. Stand-ins for the trainer (`-c`), no
torch: the training tests train through the same launcher."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from worker.local_launch import LocalRun, launch

# Rank 0 succeeds, rank 1 exits 3, rank 2 is killed by SIGKILL, rank 3 raises.
_REPORT = (
    "-c",
    "import json, os, sys\n"
    "fd = int(os.environ['NIGHTWATCH_MEMORY_TIER_FDS'])\n"
    "print(json.dumps({'pid': os.getpid(), 'ppid': os.getppid(), 'sid': os.getsid(0),\n"
    "    'comm': open('/proc/self/comm').read().strip(),\n"
    "    'argv': sys.argv, 'tier_open': os.path.exists(f'/proc/self/fd/{fd}'),\n"
    "    'env': {k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE',\n"
    "            'MASTER_PORT', 'NODE', 'SHARED', 'NIGHTWATCH_MEMORY_TIER_FDS')}}))\n"
    "rank = int(os.environ['RANK'])\n"
    "if rank == 2: os.kill(os.getpid(), 9)\n"
    "if rank == 3: raise RuntimeError('boom')\n"
    "sys.exit(3 if rank == 1 else None)\n",
)
# Rank 0 checkpoints on TERM (exit 75), rank 1 keeps the default action.
_STOPPABLE = (
    "-c",
    "import os, signal, sys, time\n"
    "if os.environ['RANK'] == '0': signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n",
)
# Every rank starts a helper, then waits forever.
_WITH_HELPER = (
    "-c",
    "import subprocess, time\n"
    "print(subprocess.Popen(['sleep', '60']).pid, flush=True)\n"
    "time.sleep(60)\n",
)


# A `-m` entry: what `preload()` imports is imported once, by the launcher, before the forks.
_MODULE = """import json, os, sys
def preload():
    import nw_stub_heavy
if __name__ == "__main__":
    print(json.dumps({"heavy": sys.modules["nw_stub_heavy"].IMPORTED_BY, "ppid": os.getppid(),
                      "argv": sys.argv[1:]}))
"""

# A `-m` entry whose preload takes a while: a stop signal can come during it.
_SLOW_IMPORT = """import time
def preload():
    print("importing", flush=True)
    time.sleep(1)
if __name__ == "__main__":
    print("trained", flush=True)
"""


def _until(run: LocalRun, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, [log.read_text() for log in run.logs]
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_ranks_are_forked_by_one_launcher_with_their_own_environment_and_log(
    tmp_path: Path,
) -> None:
    tiers = [(os.memfd_create(f"tier-{rank}"),) for rank in range(4)]
    try:
        run = launch(["--spec", "x.yaml"], 4, tmp_path / "logs", env={"SHARED": "s"},
                     entry=_REPORT, memory_tiers=tiers,
                     rank_env=[{"NODE": f"n{rank}"} for rank in range(4)])  # fmt: skip
        assert run.wait(30) == [0, 3, -signal.SIGKILL, 1]
    finally:
        for (fd,) in tiers:
            os.close(fd)
    reports = [json.loads(log.read_text().splitlines()[0]) for log in run.logs]
    assert {r["ppid"] for r in reports} == {run.launcher.pid}
    assert all(r["sid"] == r["pid"] for r in reports)  # a killpg of a rank stops its helpers
    assert [r["comm"] for r in reports] == [f"nw-rank{rank}" for rank in range(4)]
    assert [int(log.with_suffix(".pid").read_text()) for log in run.logs] == [
        r["pid"] for r in reports
    ]
    assert all(r["argv"] == ["-c", "--spec", "x.yaml"] and r["tier_open"] for r in reports)
    envs = [r["env"] for r in reports]
    assert [(e["RANK"], e["LOCAL_RANK"], e["NODE"]) for e in envs] == [
        (str(rank), str(rank), f"n{rank}") for rank in range(4)
    ]
    assert all(e["WORLD_SIZE"] == "4" and e["SHARED"] == "s" for e in envs)
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert [e["NIGHTWATCH_MEMORY_TIER_FDS"] for e in envs] == [str(fd) for (fd,) in tiers]
    assert "RuntimeError: boom" in run.logs[3].read_text()


def test_a_module_entry_is_imported_and_preloaded_once_then_run_as_main_by_each_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "nw_stub_entry.py").write_text(_MODULE)
    (tmp_path / "nw_stub_heavy.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    run = launch(["--step", "3"], 2, tmp_path / "logs", entry=("-m", "nw_stub_entry"))
    assert run.wait(30) == [0, 0]
    reports = [json.loads(log.read_text()) for log in run.logs]
    launcher = run.launcher.pid
    assert reports == [{"heavy": launcher, "ppid": launcher, "argv": ["--step", "3"]}] * 2


def test_a_stop_signal_reaches_every_rank_through_the_launcher(tmp_path: Path) -> None:
    run = launch([], 2, tmp_path / "logs", entry=_STOPPABLE)
    _until(run, lambda: all("ready" in log.read_text() for log in run.logs))
    run.signal(signal.SIGTERM)
    assert run.wait(30) == [75, -signal.SIGTERM]


def test_a_stop_signal_during_the_import_reaches_every_rank_once_forked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "nw_stub_slow.py").write_text(_SLOW_IMPORT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    run = launch([], 2, tmp_path / "logs", entry=("-m", "nw_stub_slow"))
    _until(run, lambda: "importing" in run.logs[0].read_text())
    run.signal(signal.SIGTERM)
    assert run.wait(30) == [-signal.SIGTERM] * 2
    assert "trained" not in run.logs[0].read_text() + run.logs[1].read_text()


def test_a_kill_stops_every_rank_and_its_helpers(tmp_path: Path) -> None:
    run = launch([], 2, tmp_path / "logs", entry=_WITH_HELPER)
    _until(run, lambda: all(log.read_text().strip() for log in run.logs))
    helpers = [int(log.read_text()) for log in run.logs]
    assert run.poll() == [None, None]
    run.kill()
    assert run.poll() == [-signal.SIGKILL] * 2 and run.launcher.returncode == 0
    _until(run, lambda: all(_gone(pid) for pid in helpers))


def test_an_entry_that_fails_to_import_fails_every_rank_with_its_error_in_rank_0s_log(
    tmp_path: Path,
) -> None:
    run = launch([], 2, tmp_path / "logs", entry=("-m", "megatron_runs.no_such_module"))
    assert run.wait(30) == [1, 1]
    assert "No module named 'megatron_runs.no_such_module'" in run.logs[0].read_text()
