"""One Settings object for the supervisor, read from the environment at the edge.

Nothing reads the environment at import time: `Settings.from_env()` is called by the CLI, and
tests build `Settings(...)` directly, so two apps with different databases can live in one
process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    job_setup: tuple[str, ...] = Field(
        default=(),
        description="Shell lines each SLURM job runs before its task (module load, activate).",
    )
    checkpoint_roots: tuple[Path, ...] = Field(
        default=(), description="Folders a spec's checkpoint.dir must lie inside; () = home."
    )
    data_roots: tuple[Path, ...] = Field(
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
        """Build settings from NIGHTWATCH_* variables; unset ones keep their defaults."""
        env = os.environ if env is None else env
        names = {
            "home": "NIGHTWATCH_HOME",
            "database_url": "NIGHTWATCH_DATABASE_URL",
            "prometheus_url": "NIGHTWATCH_PROMETHEUS_URL",
            "public_url": "NIGHTWATCH_PUBLIC_URL",
            "webhook_url": "NIGHTWATCH_WEBHOOK_URL",
            "tick_seconds": "NIGHTWATCH_TICK_SECONDS",
            "executor": "NIGHTWATCH_EXECUTOR",
            "host": "NIGHTWATCH_HOST",
            "port": "NIGHTWATCH_PORT",
            "token_cache_seconds": "NIGHTWATCH_TOKEN_CACHE_SECONDS",
            "workers": "NIGHTWATCH_WORKERS",
            "job_python": "NIGHTWATCH_JOB_PYTHON",
            "max_body_bytes": "NIGHTWATCH_MAX_BODY_BYTES",
            "sqlite_synchronous": "NIGHTWATCH_SQLITE_SYNCHRONOUS",
            "allow_fault_injection": "NIGHTWATCH_ALLOW_FAULT_INJECTION",
            "allow_node_drain": "NIGHTWATCH_ALLOW_NODE_DRAIN",
            "allow_smoke_checks": "NIGHTWATCH_ALLOW_SMOKE_CHECKS",
            "smoke_timeout_seconds": "NIGHTWATCH_SMOKE_TIMEOUT_SECONDS",
        }
        values: dict[str, object] = {
            field: env[var] for field, var in names.items() if env.get(var)
        }
        if env.get("NIGHTWATCH_JOB_SETUP"):
            # One shell line per line of the variable.
            values["job_setup"] = tuple(env["NIGHTWATCH_JOB_SETUP"].splitlines())
        roots = {"checkpoint_roots": "NIGHTWATCH_CHECKPOINT_ROOTS",
                 "data_roots": "NIGHTWATCH_DATA_ROOTS"}  # fmt: skip
        for field, var in roots.items():
            if env.get(var):  # os.pathsep-separated, like PATH
                values[field] = tuple(p for p in env[var].split(os.pathsep) if p)
        return cls.model_validate(values)
