"""Fixtures for the watchdog tests; synthetic training curves live in watchdog_curves.py.

`db` is a migrated, empty database of each kind: SQLite in the test's tmp dir, and
PostgreSQL (127.0.0.1:5432, trust auth) in one uniquely named database per session,
truncated between tests and dropped at the end.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from supervisor.db import Database
from supervisor.models import Base
from supervisor.spec import RecoverySpec

PG_ADMIN = os.environ.get("NIGHTWATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture
def rc() -> RecoverySpec:
    return RecoverySpec()


@pytest.fixture(scope="session")
def watchdog_pg_url() -> Iterator[str]:
    name = f"nw_watchdog_{secrets.token_hex(4)}"
    try:
        admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is required at {PG_ADMIN}: {exc}")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    db = Database(url)
    db.upgrade()
    db.dispose()
    yield url
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        database = Database(f"sqlite:///{tmp_path / 'nw.db'}")
        database.upgrade()
    else:
        database = Database(request.getfixturevalue("watchdog_pg_url"))
        tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
        with database.engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    yield database
    database.dispose()
