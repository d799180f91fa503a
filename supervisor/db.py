"""Engine and sessions for SQLite (default, WAL) and PostgreSQL, and the Alembic upgrade.

SQLite write transactions start with BEGIN IMMEDIATE: a deferred transaction that reads and then
writes can fail at once with SQLITE_BUSY when another writer got in between (WAL snapshots are
not upgradeable), and the busy timeout does not help there. Read sessions stay deferred so GETs
never queue behind writers.

Writers also queue before BEGIN IMMEDIATE: threads of one process on a lock of the engine,
processes (`serve --workers N`, a CLI) on an flock of `<db>.writer-lock`. SQLite's busy handler
polls by sleeping (1, 2, 5, 10 … 100 ms) rather than waking when the lock is freed, so 16 API
threads contending for the write lock added tens of milliseconds to a POST's p99; a Python lock
hands over at once, and the flock is polled every half millisecond.

Durability: SQLite runs `synchronous=FULL` by default, so a write the API acknowledged
survives a power loss (in WAL mode every commit syncs the log). NORMAL syncs only at
checkpoints: faster, but the last commits before a power cut may vanish, and with them runs
a CI job was told exist. docs/benchmarks.md has the cost; NIGHTWATCH_SQLITE_SYNCHRONOUS=normal
is the operator's choice to trade it back.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import sqlite3
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: Threads an API process runs sync routes on (anyio's default is 40). Two cores gain nothing
#: from more, and each thread beyond the pool's kept connections would open a connection and
#: close it again on return: PostgreSQL forks a backend for each, which at 500 requests/s cost
#: more CPU than the requests (GET fell to 431 req/s, p99 1.3 s).
REQUEST_THREADS = 16
#: Kept connections: every request thread, the submission writer, a token lookup or two.
POOL_SIZE = REQUEST_THREADS + 4
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
    """JSON for the *_json columns: evidence often holds NaN/Inf losses, datetimes, paths.

    The walk that spells out non-finite floats runs only when a plain dump finds one: most
    values (a whole run spec on every POST) have none, and the walk costs more than the dump.
    """
    try:
        return json.dumps(value, default=str, allow_nan=False)
    except (ValueError, TypeError):  # a NaN/Inf, or a key that is not a string
        return json.dumps(_sanitize(value), default=str, allow_nan=False)


def make_engine(url: str, sqlite_synchronous: str = "full") -> Engine:
    """An engine configured for concurrent API use on either backend.

    `sqlite_synchronous`: SQLite's `synchronous` pragma, "full" (durable) or "normal"."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        on_disk = parsed.database and parsed.database != ":memory:"
        file = Path(parsed.database).expanduser() if on_disk else None
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            pool_size=POOL_SIZE,
            max_overflow=POOL_SIZE,
            json_serializer=json_dumps,
        )
        _configure_sqlite(engine, _WriterLock(file), sqlite_synchronous)
        return engine
    return create_engine(
        url,
        pool_size=POOL_SIZE,
        max_overflow=POOL_SIZE,
        pool_pre_ping=True,
        json_serializer=json_dumps,
    )


class _WriterLock:
    """One writer at a time: threads queue on a lock, processes on an flock of a side file.

    Released from any thread (a session may close on the event loop); the kernel drops the
    flock of a process that dies.
    """

    POLL_S = 0.0005

    def __init__(self, database: Path | None) -> None:
        """`database`: the SQLite file; None (in memory) needs no lock between processes."""
        self._threads = threading.Lock()
        self._path = database.with_name(database.name + ".writer-lock") if database else None
        self._fd: int | None = None

    def acquire(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        if not self._threads.acquire(timeout=timeout_s):
            return False
        if self._path is None:
            return True
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            weakref.finalize(self, os.close, self._fd)
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._threads.release()
                    return False
                time.sleep(self.POLL_S)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()


def _configure_sqlite(engine: Engine, writer: _WriterLock, synchronous: str) -> None:
    if synchronous.lower() not in {"full", "normal"}:
        raise ValueError(f"sqlite synchronous must be full or normal, not {synchronous!r}")

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # the driver must not BEGIN on its own; we do below
        cursor = dbapi_conn.cursor()
        for pragma in (
            "journal_mode=WAL",
            f"busy_timeout={SQLITE_BUSY_TIMEOUT_MS}",
            "foreign_keys=ON",
            f"synchronous={synchronous.upper()}",
        ):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        if not conn.get_execution_options().get(_WRITE_OPTION, False):
            conn.exec_driver_sql("BEGIN")
            return
        if not writer.acquire(SQLITE_BUSY_TIMEOUT_MS / 1000):
            # what SQLite's own busy timeout raises, so callers handle one error
            locked = sqlite3.OperationalError("database is locked")
            raise OperationalError("BEGIN IMMEDIATE", None, locked)
        conn.info[_WRITE_OPTION] = True
        try:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            _release(conn)
            raise

    def _free(info: dict[str, Any]) -> None:
        """`info` is the pooled connection's: the same dict for a Connection and its record."""
        if info.pop(_WRITE_OPTION, False):
            writer.release()

    def _release(conn: Any, *_: Any) -> None:
        _free(conn.info)

    def _release_record(_dbapi_conn: Any, record: Any, *_: Any) -> None:
        """A connection that leaves its transaction unfinished (invalidated) frees the lock."""
        if record is not None:
            _free(record.info)

    event.listen(engine, "commit", _release)
    event.listen(engine, "rollback", _release)
    event.listen(engine, "checkin", _release_record)
    event.listen(engine, "invalidate", _release_record)


class Database:
    """One engine plus the two session flavours the API and the reconciler use."""

    def __init__(self, url: str, *, sqlite_synchronous: str = "full") -> None:
        self.url = url
        self.engine = make_engine(url, sqlite_synchronous)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(
            self.engine.execution_options(**{_WRITE_OPTION: True}), expire_on_commit=False
        )
        # PostgreSQL's READ COMMITTED gives each statement its own snapshot anyway, so a
        # read-only request loses nothing without a transaction, and saves the BEGIN and
        # ROLLBACK round trips (two of a GET's five). SQLite reads stay deferred transactions.
        autocommit = {} if self.is_sqlite else {"isolation_level": "AUTOCOMMIT"}
        self._request_read = sessionmaker(
            self.engine.execution_options(**autocommit), expire_on_commit=False
        )

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    def session(self) -> Session:
        """A session for reads (deferred transaction on SQLite)."""
        return self._read()

    def request_read_session(self) -> Session:
        """A session for one API request that only reads (no transaction on PostgreSQL);
        never write through it."""
        return self._request_read()

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
    with engine.connect() as connection:
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            _sqlite_foreign_keys(connection, on=False)
        try:
            with connection.begin():
                config.attributes["connection"] = connection
                command.upgrade(config, revision)
                if sqlite and connection.exec_driver_sql("PRAGMA foreign_key_check").first():
                    raise RuntimeError("migration left rows whose foreign keys dangle")
        finally:
            if sqlite:
                _sqlite_foreign_keys(connection, on=True)


def _sqlite_foreign_keys(connection: Any, *, on: bool) -> None:
    """Switch SQLite's foreign keys outside any transaction (inside one the pragma is a no-op).

    Off while migrating: SQLite alters a table by copying it and dropping the original, and
    with foreign keys on, that DROP deletes the rows first, cascading to every child table
    (a run's attempts, events, tokens…). Checked with `foreign_key_check` before the commit."""
    driver = connection.connection.driver_connection
    driver.execute(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")
