"""Settings from the environment, and the run state machine's invariants (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from supervisor.auth import Scope, allows
from supervisor.models import RUN_TRANSITIONS, TERMINAL_RUN_STATES, RunState, can_transition
from supervisor.settings import Settings


def test_settings_read_nightwatch_variables_only_when_asked() -> None:
    settings = Settings.from_env(
        {
            "NIGHTWATCH_HOME": "/data/nw",
            "NIGHTWATCH_TICK_SECONDS": "2.5",
            "NIGHTWATCH_EXECUTOR": "local",
            "NIGHTWATCH_PROMETHEUS_URL": "",
        }
    )
    assert settings.home == Path("/data/nw")
    assert settings.db_url == "sqlite:////data/nw/nightwatch.db"
    assert settings.tick_seconds == 2.5 and settings.executor == "local"
    assert settings.prometheus_url is None  # empty means unset
    pg = Settings.from_env({"NIGHTWATCH_DATABASE_URL": "postgresql+psycopg://u@h/db"})
    assert pg.db_url == "postgresql+psycopg://u@h/db"
    with pytest.raises(ValidationError, match="executor"):
        Settings.from_env({"NIGHTWATCH_EXECUTOR": "kubernetes"})


def test_state_machine_terminal_states_are_final_and_all_states_reachable() -> None:
    assert all(not RUN_TRANSITIONS[s] for s in TERMINAL_RUN_STATES)
    reachable = {RunState.PENDING}
    frontier = [RunState.PENDING]
    while frontier:
        for nxt in RUN_TRANSITIONS[frontier.pop()]:
            if nxt not in reachable:
                reachable.add(nxt)
                frontier.append(nxt)
    assert reachable == set(RunState)
    assert can_transition(RunState.RUNNING, RunState.RECOVERING)
    assert can_transition(RunState.RECOVERING, RunState.RUNNING)
    assert not can_transition(RunState.PENDING, RunState.RUNNING)
    for state in RunState:
        assert f"{state.value}" in (RunState.__doc__ or "")


def test_scopes_are_ordered() -> None:
    assert allows(["admin"], Scope.SUBMIT) and allows(["submit"], Scope.READ)
    assert not allows(["read"], Scope.SUBMIT) and not allows(["nonsense"], Scope.READ)
