"""One Settings object for the supervisor, read from the environment at the edge.

Nothing reads the environment at import time: `Settings.from_env()` is called by the CLI, and
tests build `Settings(...)` directly, so two apps with different databases can live in one
process. `from_env` reads, through pydantic-settings, in this order of precedence: the
`NIGHTWATCH_*` environment variables, a `.env` file (`NIGHTWATCH_ENV_FILE`, default `./.env`),
then one file per setting in a secrets folder (`NIGHTWATCH_SECRETS_DIR`, e.g. `/run/secrets`,
files named like the variables: `nightwatch_database_url`). docs/api.md has the table.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.sources.utils import parse_env_vars

Executor = Literal["auto", "slurm", "local"]
SqliteSynchronous = Literal["full", "normal"]


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    home: Path = Field(default_factory=lambda: Path.home() / ".nightwatch")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; None means SQLite at $home/nightwatch.db."
    )
    sqlite_synchronous: SqliteSynchronous = Field(
        default="full",
        description="full: an acknowledged write survives power loss; normal: faster, may not.",
    )
    prometheus_url: str | None = Field(
        default=None, description="None means scrape the workers' /metrics directly."
    )
    public_url: str = Field(
        default="http://127.0.0.1:8787", description="The URL workers use to reach the API."
    )
    webhook_url: str | None = None
    tick_seconds: float = Field(default=5.0, gt=0)
    executor: Executor = "auto"
    token_cache_seconds: float = Field(
        default=10.0, ge=0, description="How long a resolved token is trusted (revocation lag)."
    )
    max_body_bytes: int = Field(
        default=1024 * 1024, ge=1, description="Larger request bodies are refused with 413."
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8787, ge=0, le=65535)
    workers: int = Field(
        default=1, ge=1, le=64, description="API processes (the reconciler runs once, beside)."
    )
    job_python: str | None = Field(
        default=None,
        description="Interpreter of the jobs on the compute nodes; None: the supervisor's own.",
    )
    job_setup: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="Shell lines each SLURM job runs before its task (module load, activate).",
    )
    checkpoint_roots: Annotated[tuple[Path, ...], NoDecode] = Field(
        default=(), description="Folders a spec's checkpoint.dir must lie inside; () = home."
    )
    data_roots: Annotated[tuple[Path, ...], NoDecode] = Field(
        default=(), description="Folders data.prefix and data.tokenizer must lie inside; () = home."
    )
    allow_fault_injection: bool = Field(
        default=False,
        description="Let `submit` tokens send specs with `faults` (else admin only).",
    )
    allow_node_drain: bool = Field(
        default=False,
        description="Let `submit` tokens set recovery.drain_excluded_nodes (else admin only).",
    )
    allow_smoke_checks: bool = Field(
        default=False,
        description="Let admin tokens run `POST /v1/specs/validate?smoke=true`: CPU ranks (or "
        "local GPUs) training on this server's host, one check at a time.",
    )
    smoke_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description="How long one smoke check through the API may run.",
    )

    @field_validator("job_setup", mode="before")
    @classmethod
    def _lines(cls, value: Any) -> Any:
        """From a variable: one shell line per line."""
        return tuple(value.splitlines()) if isinstance(value, str) else value

    @field_validator("checkpoint_roots", "data_roots", mode="before")
    @classmethod
    def _path_list(cls, value: Any) -> Any:
        """From a variable: os.pathsep-separated, like PATH."""
        return tuple(p for p in value.split(os.pathsep) if p) if isinstance(value, str) else value

    @field_validator("checkpoint_roots", "data_roots")
    @classmethod
    def _absolute(cls, roots: tuple[Path, ...]) -> tuple[Path, ...]:
        if relative := [str(r) for r in roots if not r.is_absolute()]:
            raise ValueError(f"roots must be absolute paths: {relative}")
        return roots

    @property
    def checkpoint_root_dirs(self) -> tuple[Path, ...]:
        return self.checkpoint_roots or (self.home,)

    @property
    def data_root_dirs(self) -> tuple[Path, ...]:
        return self.data_roots or (self.home,)

    @property
    def db_url(self) -> str:
        """The effective database URL (SQLite file under home unless one is configured)."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.home / 'nightwatch.db'}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Settings from NIGHTWATCH_* variables (`env`, default the process's), the `.env`
        file and the secrets folder; unset or empty ones keep their defaults."""
        env = os.environ if env is None else env
        source = _Sources.reading(env)
        return cls.model_validate(source().model_dump(exclude_unset=True))


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping (tests pass their own)."""

    def __init__(self, settings_cls: type[BaseSettings], mapping: Mapping[str, str]) -> None:
        self.mapping = mapping
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(
            self.mapping, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str
        )


class _Sources(BaseSettings, Settings):
    """`Settings` as pydantic-settings reads it (env > .env > secrets folder)."""

    model_config = SettingsConfigDict(
        env_prefix="NIGHTWATCH_", env_ignore_empty=True, extra="ignore", frozen=True
    )

    @classmethod
    def reading(cls, env: Mapping[str, str]) -> type[_Sources]:
        """A subclass whose sources are `env`, its `.env` file and its secrets folder."""
        secrets = env.get("NIGHTWATCH_SECRETS_DIR") or None
        config = SettingsConfigDict(
            env_file=env.get("NIGHTWATCH_ENV_FILE") or ".env",
            secrets_dir=secrets if secrets and Path(secrets).is_dir() else None,
        )

        class Reading(cls):  # type: ignore[valid-type,misc]
            model_config = config

            @classmethod
            def settings_customise_sources(
                cls,
                settings_cls: type[BaseSettings],
                init_settings: PydanticBaseSettingsSource,
                env_settings: PydanticBaseSettingsSource,
                dotenv_settings: PydanticBaseSettingsSource,
                file_secret_settings: PydanticBaseSettingsSource,
            ) -> tuple[PydanticBaseSettingsSource, ...]:
                mapping = _MappingEnvSource(settings_cls, env)
                return init_settings, mapping, dotenv_settings, file_secret_settings

        return Reading
