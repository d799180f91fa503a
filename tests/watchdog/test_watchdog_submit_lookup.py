"""The job found for a submission interrupted by a crash is the newest one, by number."""

from __future__ import annotations

from pathlib import Path

from supervisor.watchdog.actions import Actuator, ActuatorConfig


class _Finder:
    """Only what `_already_submitted` asks of a cluster."""

    def find_jobs(self, job_name: str) -> list[str]:
        return ["99", "100"]


def test_newest_job_wins_across_digit_counts(tmp_path: Path) -> None:
    actuator = Actuator(None, _Finder(), ActuatorConfig(home=tmp_path), None)  # type: ignore[arg-type]
    assert actuator._already_submitted("r-1", 1, tmp_path / "logs") == "100"
