"""Which live jobs a run must not have (pure): the sweep's decision, without SLURM."""

from __future__ import annotations

from supervisor.launcher import job_name, parse_job_name
from supervisor.models import RunState
from supervisor.slurm import LiveJob
from supervisor.watchdog.strays import RunJobs, Stray, find_strays


def test_job_names_round_trip_and_foreign_names_are_none() -> None:
    assert parse_job_name(job_name("r-ab12-a", 12)) == ("r-ab12-a", 12)
    assert parse_job_name("train-llama") is None
    assert parse_job_name("nw-r-1-ax") is None


def test_ended_superseded_and_duplicate_jobs_are_strays() -> None:
    runs = {
        "r-done": RunJobs(RunState.CANCELLED, 2, "20"),
        "r-live": RunJobs(RunState.RUNNING, 3, "31"),
        "r-adopt": RunJobs(RunState.PENDING, 1, None),
    }
    live = {
        "20": LiveJob(job_name("r-done", 2)),  # its run was cancelled
        "29": LiveJob(job_name("r-live", 2)),  # attempt 2 was superseded by 3
        "31": LiveJob(job_name("r-live", 3)),  # the current attempt's own job
        "32": LiveJob(job_name("r-live", 3)),  # a second job for attempt 3
        "40": LiveJob(job_name("r-adopt", 1)),  # not recorded yet: its submission adopts it
        "50": LiveJob(job_name("r-other", 1)),  # a run this database does not hold
        "60": LiveJob("someone-else"),
    }
    assert find_strays(live, runs) == [
        Stray("r-done", 2, "20", "run cancelled"),
        Stray("r-live", 2, "29", "attempt 2 superseded by attempt 3"),
        Stray("r-live", 3, "32", "attempt 3 already has job 31"),
    ]
