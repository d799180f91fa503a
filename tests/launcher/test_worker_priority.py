"""A node task that runs no ranks yet imports at the lowest CPU priority, and only when it can
return to its own afterwards (`worker.priority`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from worker import priority


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def test_the_body_runs_at_nice_19_and_the_priority_returns() -> None:
    if not priority.may_raise_priority_to(_nice()):
        pytest.skip("this process may not lower its nice value again")
    own = _nice()
    with priority.lowest_priority(True, {}):
        assert _nice() == priority.LOWEST_PRIORITY
    assert _nice() == own


def test_not_when_disabled_nor_when_it_could_not_return(monkeypatch: pytest.MonkeyPatch) -> None:
    own = _nice()
    with priority.lowest_priority(False, {}):
        assert _nice() == own
    monkeypatch.setattr(priority, "may_raise_priority_to", lambda nice: False)
    with priority.lowest_priority(True, {}):
        assert _nice() == own
    assert _nice() == own


def test_a_session_leader_sets_its_autogroup_too() -> None:
    """With autogroups a nice value weighs only within the session: a node task leading its
    session (as each SLURM task does) sets its autogroup's nice value as well, and back."""
    if not priority.AUTOGROUP.exists() or not priority.may_raise_priority_to(_nice()):
        pytest.skip("no autogroups here, or no way back from nice 19")
    probe = (
        "from worker.priority import AUTOGROUP, lowest_priority\n"
        "group = lambda: AUTOGROUP.read_text().split()[-1]\n"
        "before = group()\n"
        "with lowest_priority(True, {}):\n"
        "    inside = group()\n"
        "print(before, inside, group())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
        start_new_session=True, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    before, inside, after = out.stdout.split()
    assert (inside, after) == (str(priority.LOWEST_PRIORITY), before)


def test_an_order_that_needs_the_node_returns_its_priority_during_the_import() -> None:
    if not priority.may_raise_priority_to(_nice()):
        pytest.skip("this process may not lower its nice value again")
    own, order = _nice(), threading.Event()
    with priority.lowest_priority(True, {}, needed=order.is_set):
        assert _nice() == priority.LOWEST_PRIORITY
        order.set()
        deadline = time.monotonic() + 30
        while _nice() != own and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _nice() == own
    assert _nice() == own


def test_a_node_already_ordered_never_lowers_its_priority() -> None:
    """The order came before the import (a successor requeued before its node tasks began):
    the body runs at the node's own priority from the start."""
    if not priority.may_raise_priority_to(_nice()):
        pytest.skip("this process may not lower its nice value again")
    own, seen = _nice(), []
    with priority.lowest_priority(True, {}, needed=lambda: True):
        seen.append(_nice())
    assert seen == [own] and _nice() == own
