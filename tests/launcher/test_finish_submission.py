"""A submission cut short between sbatch and submitit moving the job's pickle (the supervisor
was SIGKILLed there): the job exists, so `find_jobs` adopts it instead of submitting again, but
it waits 60 s for `<job id>/<job id>_submitted.pkl` and then fails like a program error (seen
on the real cluster: the run went to needs_attention). `SlurmCluster.finish_submission` moves
the orphan pickle into place. No SLURM needed: a fake `sbatch` accepts the job."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import submitit

from supervisor.slurm import JobRequest, SlurmCluster


class _Killed(BaseException):
    """The supervisor's death right after sbatch answered."""


def _interrupted_submit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job_id: str) -> Path:
    """Submit through the real submitit path; die where a SIGKILL would leave the pickle."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\necho 'Submitted batch job {job_id}'\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    move = submitit.core.utils.JobPaths.move_temporary_file

    def die_before_pickle(self, tmp: Path, name: str, keep_as_symlink: bool = False) -> None:
        if name == "submitted_pickle":
            raise _Killed
        move(self, tmp, name, keep_as_symlink)

    monkeypatch.setattr(submitit.core.utils.JobPaths, "move_temporary_file", die_before_pickle)
    log_dir = tmp_path / "logs" / "a1"
    request = JobRequest(job_name="nw-r-1-a1", log_dir=log_dir, nodes=1, tasks_per_node=1)
    with pytest.raises(_Killed):
        SlurmCluster().submit(request, functools.partial(max, 1, int(job_id)))
    monkeypatch.setattr(submitit.core.utils.JobPaths, "move_temporary_file", move)
    return log_dir


def test_orphan_pickle_is_moved_where_the_job_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log_dir = _interrupted_submit(tmp_path, monkeypatch, "50")
    pickle = submitit.core.utils.JobPaths(log_dir / "%j", job_id="50").submitted_pickle
    assert not pickle.exists() and list(log_dir.glob("*.pkl"))
    assert SlurmCluster().finish_submission("50", log_dir)
    assert submitit.core.utils.DelayedSubmission.load(pickle).result() == 50
    assert not list(log_dir.glob("*.pkl"))
    assert not SlurmCluster().finish_submission("50", log_dir)  # done once, then a no-op


def test_the_newest_orphan_is_the_adopted_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older orphan is from an sbatch that got no job (else it would have been adopted)."""
    _interrupted_submit(tmp_path, monkeypatch, "40")
    older = next((tmp_path / "logs" / "a1").glob("*.pkl"))
    os.utime(older, (1, 1))
    log_dir = _interrupted_submit(tmp_path, monkeypatch, "41")
    assert SlurmCluster().finish_submission("41", log_dir)
    pickle = submitit.core.utils.JobPaths(log_dir / "%j", job_id="41").submitted_pickle
    assert submitit.core.utils.DelayedSubmission.load(pickle).result() == 41
    assert older.exists()


def test_nothing_to_finish_without_an_orphan(tmp_path: Path) -> None:
    (tmp_path / "a1").mkdir()
    assert not SlurmCluster().finish_submission("7", tmp_path / "a1")
