"""scripts/devcluster trusts a pid file only for a process that was running when the file was
written: a pid the kernel has since given to another process is no daemon of the cluster (a
second `make test` on one machine skipped starting two slurmd for that reason and timed out)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _devcluster() -> ModuleType:
    loader = SourceFileLoader("devcluster", str(REPO / "scripts" / "devcluster"))
    spec = importlib.util.spec_from_loader("devcluster", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["devcluster"] = module  # its dataclasses look their module up there
    loader.exec_module(module)
    return module


def test_a_pid_file_older_than_the_process_it_names_names_no_daemon(tmp_path: Path) -> None:
    dc = _devcluster()
    pidfile = tmp_path / "slurmd.n1.pid"
    pidfile.write_text(f"{os.getpid()}\n")  # written while this process runs: its daemon
    assert dc.read_pid(pidfile) == os.getpid()
    started = dc.started_at(os.getpid())
    assert started is not None and started <= time.time()
    stale = started - 3600  # the file is from an hour before this process began
    os.utime(pidfile, (stale, stale))
    assert dc.read_pid(pidfile) is None
    pidfile.write_text("not a pid\n")
    assert dc.read_pid(pidfile) is None and dc.read_pid(tmp_path / "none.pid") is None
