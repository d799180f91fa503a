"""Fixtures for the watchdog tests; synthetic training curves live in watchdog_curves.py."""

from __future__ import annotations

import pytest

from supervisor.spec import RecoverySpec


@pytest.fixture
def rc() -> RecoverySpec:
    return RecoverySpec()
