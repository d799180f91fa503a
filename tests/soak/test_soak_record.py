"""A run's record reads back as the same run, and only for the spec it trained."""

from __future__ import annotations

import json

import pytest

from benchmarks.soak.driver import SystemRun
from benchmarks.soak.progress import Progress, StartEvent, StepEvent
from benchmarks.soak.record import RecordMismatch, from_record, to_record
from benchmarks.soak.schedule import FaultKind, ScheduledFault
from benchmarks.soak.score import Injection, Remedy

SPEC = {"name": "chaos-soak", "training": {"train_steps": 40}, "faults": [{"kind": "nan"}]}


def a_run() -> SystemRun:
    progress = Progress(
        [
            StartEvent(10.0, 0, "5/0", ("n1", "n2"), 0),
            StartEvent(20.5, 10, "6/1", ("n3", "n2"), 80, ((96, 104), (120, 128))),
        ],
        [
            StepEvent(11.0, 1, 9.5, "5/0", False, 0.12, 8),
            StepEvent(21.0, 11, 8.25, "6/1", True, None, None),
        ],
    )
    injections = [
        Injection(ScheduledFault(FaultKind.POISON_DATA, 12, {"window": [96, 104]}), 15.0, "ok"),
        Injection(ScheduledFault(FaultKind.NODE_DEATH, 30, {}), None, "", "n1", "5"),
    ]
    remedies = [
        Remedy(16.0, "rollback", (), "loss_spike", "5", ((96, 104),), ("n1",), ("n1", "n2")),
        Remedy(19.0, "exclude_node", ("n1",), "node_dead", "5"),
    ]
    return SystemRun(
        "nightwatch", 9.0, 40.0, 40, progress, injections, remedies, 1, "succeeded",
        {"run_id": "r1", "report": {"ettr": 0.97}},
    )  # fmt: skip


def test_a_record_reads_back_as_the_same_run() -> None:
    run = a_run()
    text = json.dumps(to_record(run, SPEC))
    assert from_record(json.loads(text), SPEC) == run


def test_a_record_of_another_spec_is_refused() -> None:
    record = json.loads(json.dumps(to_record(a_run(), SPEC)))
    other = {**SPEC, "training": {"train_steps": 41}}
    with pytest.raises(RecordMismatch):
        from_record(record, other)
