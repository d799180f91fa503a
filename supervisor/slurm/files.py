"""A job's folder, as both backends lay it out through submitit: made private before
submitting, and read back (log files, their tails) when the job is done.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

#: Everything a submission creates is the supervisor user's alone (dirs 0700, files 0600).
PRIVATE_UMASK = 0o077
_umask_lock = threading.Lock()


@contextlib.contextmanager
def private_submission(log_dir: Path) -> Iterator[None]:
    """The submission folder, private: submitit's pickles hold the task, and the task holds the
    job's environment, the run's worker token among it.

    `log_dir` is made (or tightened to) 0700, and the umask is 077 while submitit writes its
    pickles and starts the job: sbatch hands that umask to the job (SLURM_UMASK) and a local
    job inherits it, so the job's logs are private too. The umask is process-wide, so other
    threads' files created meanwhile are private as well (never less so); the lock keeps two
    submissions from restoring each other's umask."""
    with _umask_lock:
        previous = os.umask(PRIVATE_UMASK)
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            log_dir.chmod(0o700)
            yield
        finally:
            os.umask(previous)


def job_log_files(log_dir: Path | None, job_id: str) -> list[Path]:
    """The job's task logs in `log_dir` (the attempt's folder or the job's own)."""
    if log_dir is None:
        return []
    folder = log_dir if log_dir.name == job_id else log_dir / job_id
    return sorted(folder.glob(f"{job_id}_*_log.out"))


def tail(path: Path, max_bytes: int = 64 * 1024) -> str:
    """The end of a log file (a missing file reads as empty: the job may not have started)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def read_from(path: Path, offset: int, max_bytes: int) -> tuple[str, int]:
    """Up to `max_bytes` of the file from byte `offset`, cut back to the last whole line, and
    the offset to read on from (a missing file reads as empty: the task has not started).
    A line longer than `max_bytes` is returned in pieces rather than never."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read(max_bytes)
    except FileNotFoundError:
        return "", offset
    if len(data) == max_bytes and b"\n" in data:
        data = data[: data.rindex(b"\n") + 1]
    return data.decode("utf-8", errors="replace"), offset + len(data)


def last_lines(path: Path, lines: int, max_bytes: int) -> tuple[str, int]:
    """The file's last `lines` whole lines (within its last `max_bytes`), and its size: where
    a follower reads on from."""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            fh.seek(start)
            data = fh.read()
    except FileNotFoundError:
        return "", 0
    if start > 0 and b"\n" in data:
        data = data[data.index(b"\n") + 1 :]  # drop the partial first line
    kept = data.splitlines(keepends=True)[-lines:] if lines else []
    return b"".join(kept).decode("utf-8", errors="replace"), size
