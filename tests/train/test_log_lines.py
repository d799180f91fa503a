"""The training log's JSON lines stay whole when ranks share a file descriptor.

A node task's forked ranks (`worker.ranks`) write to its one log; a line written in two
pieces (print()'s text, then its newline) lets another rank's output in between, and a line
torn that way is lost to every reader of the log. Each line must be one write call: the kernel
keeps one write to a pipe (up to PIPE_BUF) or a shared file whole.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from contracts.task import TrainContext


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_every_log_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_runs.setup import Log

    stream = _Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    log = Log(TrainContext(run_id="r", attempt=1, node="n1", checkpoint_dir=Path(".")), 0)
    log("train_start", step=5, nodes=["n1", "n2"])
    log("step", step=6, loss=3.2)
    assert [json.loads(c)["event"] for c in stream.calls] == ["train_start", "step"]
    assert all(c.endswith("\n") and c.count("\n") == 1 for c in stream.calls)
