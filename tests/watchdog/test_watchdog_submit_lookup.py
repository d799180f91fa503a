"""The job found for a submission interrupted by a crash is the newest one, by number."""

from __future__ import annotations

from pathlib import Path

from supervisor.watchdog.actions import Actuator, ActuatorConfig


class _Finder:
    """Only what `_already_submitted` asks of a cluster."""

    def find_jobs(self, job_name: str) -> list[str]:
        return ["99", "100"]

    def finish_submission(self, job_id: str, log_dir: Path) -> bool:
        return False


def test_newest_job_wins_across_digit_counts(tmp_path: Path) -> None:
    actuator = Actuator(None, _Finder(), ActuatorConfig(home=tmp_path), None)  # type: ignore[arg-type]
    assert actuator._already_submitted("r-1", 1, tmp_path / "logs") == "100"


class _Adopter(_Finder):
    """A cluster that can finish a submission the crash cut short (SlurmCluster)."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, Path]] = []

    def finish_submission(self, job_id: str, log_dir: Path) -> bool:
        self.finished.append((job_id, log_dir))
        return True


def test_adopted_job_gets_its_submission_finished(tmp_path: Path) -> None:
    """A kill between sbatch and submitit's pickle move left the job without its task: the
    adopted job is handed the attempt's log folder, where the orphan pickle is."""
    cluster = _Adopter()
    actuator = Actuator(None, cluster, ActuatorConfig(home=tmp_path), None)  # type: ignore[arg-type]
    assert actuator._already_submitted("r-1", 1, tmp_path / "logs") == "100"
    assert cluster.finished == [("100", tmp_path / "logs")]
