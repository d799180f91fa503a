"""Suite-wide fixtures: the two databases every part is tested against.

Each area keeps its own fixtures in tests/<area>/conftest.py. PostgreSQL: one uniquely named
database per test session on 127.0.0.1:5432 (trust auth), migrated once, truncated between
tests, dropped at the end.
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

PG_ADMIN = os.environ.get("NIGHTWATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    name = f"nw_test_{secrets.token_hex(4)}"
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
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A migrated, empty database of each kind."""
    if request.param == "sqlite":
        db = Database(f"sqlite:///{tmp_path / 'nightwatch.db'}")
        db.upgrade()
    else:
        db = Database(request.getfixturevalue("pg_url"))
        tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
        with db.engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    yield db
    db.dispose()
