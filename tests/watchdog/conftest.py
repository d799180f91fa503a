"""Fixtures for the watchdog tests; synthetic training curves live in watchdog_curves.py.

`db` is a migrated, empty database of each kind (tests/conftest.py's `database`).
"""

from __future__ import annotations

import pytest

from contracts.spec import RecoverySpec
from supervisor.db import Database


@pytest.fixture
def rc() -> RecoverySpec:
    return RecoverySpec()


@pytest.fixture
def db(database: Database) -> Database:
    """The suite-wide `database` fixture (SQLite and PostgreSQL) under the watchdog's name."""
    return database
