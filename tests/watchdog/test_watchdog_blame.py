"""Log classification on captured job output (no SLURM needed)."""

from __future__ import annotations

from pathlib import Path

from supervisor.watchdog.blame import LogKind, classify, log_cause, suspect_hosts
from supervisor.watchdog.snapshot import Cause

CAPTURED = Path(__file__).parent / "captured"

GLOO_PEER = (CAPTURED / "gloo_peer.txt").read_text()

NCCL = (CAPTURED / "nccl_remote.txt").read_text()

NODE_FAIL = (CAPTURED / "node_fail.txt").read_text()

OOM = (CAPTURED / "oom.txt").read_text()

TIMEOUT_AND_CRASH = (CAPTURED / "timeout_and_crash.txt").read_text()


def kinds(text: str) -> list[LogKind]:
    return [f.kind for f in classify(text)]


def test_gloo_error_names_peer_and_exception_and_exit():
    findings = classify(GLOO_PEER)
    assert [f.kind for f in findings] == [LogKind.COLLECTIVE_ERROR, LogKind.TASK_EXIT]
    assert findings[0].host == "127.0.0.1"
    assert (findings[1].host, findings[1].exit_code) == ("n1", 1)


def test_python_exception_outside_collectives():
    text = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad shape\n'
    (finding,) = classify(text)
    assert finding.kind is LogKind.PYTHON_EXCEPTION and finding.detail == "ValueError"


def test_nccl_names_remote_host():
    findings = classify(NCCL)
    assert kinds(NCCL) == [LogKind.COLLECTIVE_ERROR, LogKind.COLLECTIVE_ERROR]
    assert findings[0].host == "gpu13.cluster"
    assert suspect_hosts(findings) == ["gpu13.cluster"]


def test_node_failure_and_oom_and_time_limit():
    (node,) = classify(NODE_FAIL)
    assert node.kind is LogKind.NODE_FAILURE and node.host == "n1"
    assert kinds(OOM) == [LogKind.OUT_OF_MEMORY, LogKind.OUT_OF_MEMORY]
    limit, crash = classify(TIMEOUT_AND_CRASH)
    assert limit.kind is LogKind.TIME_LIMIT and limit.host == "n3"
    assert (crash.kind, crash.host, crash.exit_code) == (LogKind.TASK_EXIT, "n2", 76)


def test_clean_log_has_no_findings():
    assert classify("toy: rank 0/4 on n1 starts at step 0\nall good\n") == []


def test_tasks_killed_by_slurms_stop_warning_are_nobodys_fault() -> None:
    """USR2 (`--signal=USR2@lead`) that lands before a task installed its handler kills it:
    the walltime's or the preemption's doing, requeued like a checkpointed stop."""
    text = (
        "submitit INFO (2026-11-28 11:48:10,343) - Loading pickle: /tmp/logs/59/59_submitted.pkl\n"
        "srun: error: n1: task 0: User defined signal 2\n"
        "srun: error: n2: task 1: User defined signal 2\n"
    )
    cause, line, nodes = log_cause(text, None, True, ("n1", "n2"))
    assert (cause, nodes) == (Cause.INFRA, ()) and "User defined signal 2" in (line or "")
