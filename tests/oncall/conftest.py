"""Fixtures for the on-call tests; what they start lives in `oncall_live`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from oncall_live import LivePrometheus, running_stack


@pytest.fixture(scope="module")
def live_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LivePrometheus]:
    """A real Prometheus scraping a simulated two-node run and the supervisor."""
    with running_stack(tmp_path_factory.mktemp("prometheus")) as live:
        yield live
