"""Nightwatch under the schedule: submit through the REST API, let the watchdog do its job.

The driver only reads: the run and its attempts from the API (to know which job to hurt),
the training log (ground truth), and after the run the actions the supervisor recorded (what
it did, when) from its database.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
from sqlalchemy import select

from benchmarks.soak.driver import SystemRun, drive, end_time, with_struck_nodes
from benchmarks.soak.faults import Injector, JobView, slurm
from benchmarks.soak.progress import LogFollower, with_skips
from benchmarks.soak.reference import Skips, normalized
from benchmarks.soak.schedule import Schedule
from benchmarks.soak.score import Remedy
from benchmarks.soak.services import Cluster, Supervisor
from supervisor.models import Action, Attempt, Incident, Run

#: Recorded actions that are remedies (submit / cancel / complete are bookkeeping).
REMEDY_KINDS = frozenset({"restart", "rollback", "exclude_node", "requeue", "escalate"})
FINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "needs_attention"})


class Api:
    """The few API calls the soak makes, tolerant of the supervisor being down (it is
    SIGKILLed on purpose): a failed read returns the last answer."""

    def __init__(self, url: str, token: str) -> None:
        self.client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=5
        )
        self.last_run: dict[str, Any] = {}

    def submit(self, spec: dict[str, Any]) -> str:
        resp = self.client.post("/v1/runs", json=spec)
        resp.raise_for_status()
        return str(resp.json()["id"])

    def run(self, run_id: str) -> dict[str, Any]:
        try:
            resp = self.client.get(f"/v1/runs/{run_id}")
            resp.raise_for_status()
        except httpx.HTTPError:
            return self.last_run
        self.last_run = resp.json()
        return self.last_run

    def report(self, run_id: str) -> dict[str, Any] | None:
        try:
            resp = self.client.get(f"/v1/runs/{run_id}/report")
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            return {"error": str(exc)}
        return resp.json()

    def close(self) -> None:
        self.client.close()


def run_nightwatch(
    spec: dict[str, Any],
    schedule: Schedule | None,
    cluster: Cluster,
    supervisor: Supervisor,
    tokens: dict[str, str],
    budget_s: float,
    say: Callable[[str], None],
) -> SystemRun:
    api = Api(supervisor.url, tokens["admin"])
    injector = Injector(
        cluster, supervisor, sd_url=f"{supervisor.url}/v1/prometheus/targets",
        sd_token=tokens["read"],
    )  # fmt: skip
    submit_t = time.time()
    run_id = api.submit(spec)
    say(f"nightwatch run {run_id}")
    run_dir = supervisor.home / "runs" / run_id
    follower = LogFollower(run_dir / "logs", "a*/*/*_0_log.out")

    def current_job() -> JobView:
        attempts = api.run(run_id).get("attempts") or [{}]
        last = attempts[-1]
        return JobView(last.get("job_id"), tuple(last.get("nodes") or ()), run_dir / "checkpoints")

    def finished() -> str | None:
        state = api.run(run_id).get("state")
        return state if state in FINAL_STATES else None

    faults = list(schedule.faults) if schedule else []
    try:
        injections, state = drive(
            faults, follower, current_job, finished, injector, submit_t + budget_s, say
        )
        injections = with_struck_nodes(injections, run_dir / "checkpoints")
        if state != "succeeded":
            # An escalated run keeps its job; the next system must have the cluster to itself.
            api.client.post(f"/v1/runs/{run_id}/cancel")
            job = current_job().job_id
            if job:
                slurm(cluster, "scancel", job)
        report = api.report(run_id)
    finally:
        api.close()
        injector.revive_all()
    remedies, escalations = recorded_remedies(supervisor, run_id)
    progress = with_skips(follower.poll(), attempt_skips(supervisor, run_id))
    target = int(spec["training"]["train_steps"])
    return SystemRun(
        system="nightwatch",
        submit_t=submit_t,
        end_t=end_time(progress, target, time.time()),
        target_steps=target,
        progress=progress,
        injections=injections,
        remedies=remedies,
        escalations=escalations,
        final_state=state,
        extra={"run_id": run_id, "report": report},
    )


def recorded_remedies(supervisor: Supervisor, run_id: str) -> tuple[list[Remedy], int]:
    """The supervisor's own record of its remedies (one row per action, intent first)."""
    db = supervisor.database()
    try:
        with db.session() as s:
            actions = s.scalars(
                select(Action).where(Action.run_id == run_id).order_by(Action.created_at)
            ).all()
            run = s.get(Run, run_id)
            needs_attention = run is not None and run.state.value == "needs_attention"
            remedies = [
                remedy_of(
                    a.created_at.timestamp(), a.kind, a.evidence_json or {}, a.result_json or {}
                )
                for a in actions
                if a.kind in REMEDY_KINDS
            ]
            held = s.scalars(
                select(Incident).where(Incident.run_id == run_id, Incident.kind == "contained")
            ).all()
            remedies += [
                contained_of(i.detected_ts.timestamp(), i.evidence_json or {}) for i in held
            ]
            remedies.sort(key=lambda r: r.t)
    finally:
        db.dispose()
    escalations = sum(1 for r in remedies if r.kind == "escalate")
    return remedies, max(escalations, int(needs_attention))


def remedy_of(
    t: float, kind: str, evidence: dict[str, Any], result: dict[str, Any] | None = None
) -> Remedy:
    """A recorded action with the cause it names (`actions.remedy_evidence`) and the job its
    next attempt started in (its outcome)."""
    moved = (result or {}).get("job_id")
    return Remedy(
        t,
        kind,
        tuple(evidence.get("exclude_nodes") or ()),
        cause=evidence.get("finding_kind"),
        job_id=None if evidence.get("job_id") is None else str(evidence["job_id"]),
        skips=normalized(evidence.get("skip_ranges") or ()),
        finding_nodes=tuple(evidence.get("finding_nodes") or ()),
        attempt_nodes=tuple(evidence.get("attempt_nodes") or ()),
        moved_to=None if moved is None else str(moved),
    )


def contained_of(t: float, evidence: dict[str, Any]) -> Remedy:
    """A contained fault's incident as the soak scores it: no action, the cause it names."""
    return Remedy(
        t,
        "contained",
        cause="loss_spike" if evidence.get("episode") == "spike" else "nonfinite",
        skips=normalized(evidence.get("bad_samples") or ()),
        finding_nodes=tuple(evidence.get("nodes") or ()),
    )


def attempt_skips(supervisor: Supervisor, run_id: str) -> dict[int, Skips]:
    """The skip ranges each attempt was submitted with (the trainer's log does not say)."""
    db = supervisor.database()
    try:
        with db.session() as s:
            rows = s.scalars(select(Attempt).where(Attempt.run_id == run_id)).all()
            return {a.number: normalized(a.skip_ranges_json or ()) for a in rows}
    finally:
        db.dispose()
