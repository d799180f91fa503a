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


def test_settings_come_from_the_environment_then_a_dotenv_file_then_a_secrets_folder(
    tmp_path: Path,
) -> None:
    dotenv = tmp_path / "nightwatch.env"
    dotenv.write_text("NIGHTWATCH_TICK_SECONDS=3\nNIGHTWATCH_WORKERS=4\nOTHER_TOOL=1\n")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "nightwatch_database_url").write_text("postgresql+psycopg://u:pw@h/db")
    (secrets / "nightwatch_workers").write_text("8")
    env = {
        "NIGHTWATCH_ENV_FILE": str(dotenv),
        "NIGHTWATCH_SECRETS_DIR": str(secrets),
        "NIGHTWATCH_TICK_SECONDS": "2",
        "NIGHTWATCH_JOB_SETUP": "module load cuda\nsource /env/bin/activate",
        "NIGHTWATCH_DATA_ROOTS": "/data/a:/data/b",
    }
    settings = Settings.from_env(env)
    assert settings.tick_seconds == 2.0  # the environment wins over the .env file
    assert settings.workers == 4  # the .env file wins over the secrets folder
    assert settings.database_url == "postgresql+psycopg://u:pw@h/db"  # a secret file
    assert settings.job_setup == ("module load cuda", "source /env/bin/activate")
    assert settings.data_roots == (Path("/data/a"), Path("/data/b"))
    assert Settings(home=tmp_path).tick_seconds == 5.0  # built directly: no environment read
    with pytest.raises(ValidationError, match="absolute"):
        Settings.from_env({"NIGHTWATCH_CHECKPOINT_ROOTS": "relative/dir"})


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


def test_every_setting_is_in_the_configuration_table() -> None:
    table = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    missing = [f"NIGHTWATCH_{name.upper()}" for name in Settings.model_fields
               if f"`NIGHTWATCH_{name.upper()}`" not in table]  # fmt: skip
    assert missing == []
