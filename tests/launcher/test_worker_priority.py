"""A node task that runs no ranks yet imports at the lowest CPU priority, and only when it can
return to its own afterwards (`worker.priority`)."""

from __future__ import annotations

import os

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
