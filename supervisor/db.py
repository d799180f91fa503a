"""Engine and sessions for SQLite (default, WAL) and PostgreSQL, and the Alembic upgrade.

SQLite write transactions start with BEGIN IMMEDIATE: a deferred transaction that reads and then
writes can fail at once with SQLITE_BUSY when another writer got in between (WAL snapshots are
not upgradeable), and the busy timeout does not help there. Read sessions stay deferred so GETs
never queue behind writers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
_WRITE_OPTION = "nightwatch_write"


def _sanitize(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf": PostgreSQL's json type rejects NaN tokens
    if isinstance(value, dict):
        return {str(k): _sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_sanitize(v) for v in value]
    return value


def json_dumps(value: Any) -> str:
    """JSON for the *_json columns: evidence often holds NaN/Inf losses, datetimes, paths."""
    return json.dumps(_sanitize(value), default=str, allow_nan=False)


def make_engine(url: str) -> Engine:
    """An engine configured for concurrent API use on either backend."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            pool_size=16,
            max_overflow=32,
            json_serializer=json_dumps,
        )
        _configure_sqlite(engine)
        return engine
    return create_engine(
        url, pool_size=10, max_overflow=30, pool_pre_ping=True, json_serializer=json_dumps
    )


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # the driver must not BEGIN on its own; we do below
        cursor = dbapi_conn.cursor()
        for pragma in (
            "journal_mode=WAL",
            f"busy_timeout={SQLITE_BUSY_TIMEOUT_MS}",
            "foreign_keys=ON",
            "synchronous=NORMAL",
        ):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get(_WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


class Database:
    """One engine plus the two session flavours the API and the reconciler use."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(
            self.engine.execution_options(**{_WRITE_OPTION: True}), expire_on_commit=False
        )

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    def session(self) -> Session:
        """A session for reads (deferred transaction on SQLite)."""
        return self._read()

    def write_session(self) -> Session:
        """A session whose transactions take the SQLite write lock up front."""
        return self._write()

    def upgrade(self) -> None:
        upgrade(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply Alembic migrations programmatically, so `nightwatch db upgrade` works anywhere."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
