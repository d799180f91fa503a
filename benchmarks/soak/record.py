"""A system's run under the schedule as JSON, kept beside a soak's result (pure).

A later process reads it back to train that run's exact reference and score the two
(`chaos_soak.py --nightwatch-from`): a full soak does not fit in one call of a lent machine.
The record holds the spec the run trained, so a reference is never planned for another soak.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from benchmarks.soak.driver import SystemRun
from benchmarks.soak.progress import Progress, StartEvent, StepEvent
from benchmarks.soak.schedule import FaultKind, ScheduledFault
from benchmarks.soak.score import Injection, Remedy

RUN_RECORD = "nightwatch_run.json"


class RecordMismatch(Exception):
    """The record is of another soak (its spec differs from this one's)."""


def to_record(run: SystemRun, spec: dict[str, Any]) -> dict[str, Any]:
    data = asdict(run)
    for injection in data["injections"]:
        injection["fault"]["kind"] = injection["fault"]["kind"].value
    return {"spec": spec, "run": data}


def from_record(record: dict[str, Any], spec: dict[str, Any]) -> SystemRun:
    """The run, if it trained `spec` exactly; else RecordMismatch."""
    if record.get("spec") != json.loads(json.dumps(spec)):
        raise RecordMismatch("the recorded run trained another spec (seed, steps, data or shape)")
    data = record["run"]
    progress = Progress(
        [_start(s) for s in data["progress"]["starts"]],
        [StepEvent(**e) for e in data["progress"]["steps"]],
    )
    return SystemRun(
        system=data["system"],
        submit_t=data["submit_t"],
        end_t=data["end_t"],
        target_steps=data["target_steps"],
        progress=progress,
        injections=[_injection(i) for i in data["injections"]],
        remedies=[_remedy(r) for r in data["remedies"]],
        escalations=data["escalations"],
        final_state=data["final_state"],
        extra=data["extra"],
    )


def _start(s: dict[str, Any]) -> StartEvent:
    return StartEvent(
        s["t"], s["step"], s["incarnation"], tuple(s["nodes"]), s["cursor"],
        tuple(tuple(r) for r in s["skips"]),
    )  # fmt: skip


def _remedy(r: dict[str, Any]) -> Remedy:
    return Remedy(
        r["t"], r["kind"], tuple(r["nodes"]), r["cause"], r["job_id"],
        tuple(tuple(s) for s in r["skips"]), tuple(r["finding_nodes"]),
        tuple(r["attempt_nodes"]), r.get("moved_to"),
    )  # fmt: skip


def _injection(i: dict[str, Any]) -> Injection:
    fault = ScheduledFault(
        FaultKind(i["fault"]["kind"]), i["fault"]["at_step"], i["fault"]["params"]
    )
    return Injection(fault, i["t"], i["note"], i["node"], i["job_id"])
