"""The ledger: what the tick learned about a run's attempts and incidents, written down.

Each function writes in one transaction: the attempt mirrored from SLURM with the run's
SUBMITTED → RUNNING, the new checkpoints and the attempt's start-up time, and the incidents a
later attempt recovered from (with RECOVERING → RUNNING) commit together or not at all; so do
an incident and the remedy chosen for it. The field values are worked out by pure functions
first, and no transaction is opened when there is nothing to write (a healthy run's tick
writes nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from contracts import exitcodes
from contracts.checkpoints import CheckpointInfo, SaveTiming
from supervisor import accounting, store
from supervisor.db import Database
from supervisor.metrics_in import MetricsView, SourceHealth
from supervisor.models import (
    Attempt,
    AttemptState,
    EventKind,
    Incident,
    IncidentState,
    Run,
    RunState,
)
from supervisor.watchdog.detectors.trainer import Episode
from supervisor.watchdog.observe import as_datetime
from supervisor.watchdog.snapshot import Cause, FindingKind, JobView, Remedy, RemedyKind


@dataclass(frozen=True)
class Recovery:
    """An incident a later attempt recovered from."""

    incident: Incident
    recovered_t: float
    steps_lost: int | None


def attempt_update(attempt: Attempt, job: JobView, now: float) -> dict[str, Any]:
    """The columns that mirror SLURM's view into the attempt row, once per change (pure)."""
    if job.health is not SourceHealth.UP or job.state is None:
        return {}
    new = job.state
    if new is AttemptState.FAILED and job.exit_code == exitcodes.REQUEUE:
        new = AttemptState.PREEMPTED  # checkpointed on USR2/TERM; SLURM says FAILED 75
    if new is AttemptState.SUBMITTED or attempt.state is new or attempt.ended_at is not None:
        return {}
    fields: dict[str, Any] = {"state": new}
    if job.nodes:
        fields["nodes_json"] = list(job.nodes)
    if new is AttemptState.RUNNING:
        fields["started_at"] = attempt.started_at or as_datetime(now)
    else:
        fields.update(ended_at=as_datetime(now), exit_code=job.exit_code, end_reason=job.reason)
    return fields


def first_step_seconds(
    started_at: datetime | None, attempt: Attempt, view: MetricsView
) -> float | None:
    """How long the attempt took from its start to its first step, once its first sample is
    in (pure); None before that, or when it was measured already. An attempt first seen long
    after its start overestimates, which only loosens the start-up hang limit."""
    if started_at is None or attempt.first_step_s is not None:
        return None
    stamps = [s.last_step_ts for s in view.samples if s.last_step_ts]
    return min(stamps) - started_at.timestamp() if stamps else None


def recoveries(
    attempt: Attempt, view: MetricsView, incidents: Sequence[Incident]
) -> list[Recovery]:
    """Remedied incidents a later attempt has trained past the resume step of (pure)."""
    if view.health is not SourceHealth.UP:
        return []
    out = []
    for incident in [i for i in incidents if i.state is IncidentState.REMEDYING]:
        ev = incident.evidence_json or {}
        if attempt.number <= int(ev.get("remedy_attempt") or incident.attempt or 0):
            continue
        resumed = ev.get("resume_from")
        recovered_t = accounting.recovery_time(view.samples, resumed)
        if recovered_t is not None:
            lost = accounting.steps_lost(ev.get("step"), resumed)
            out.append(Recovery(incident, recovered_t, lost))
    return out


class Ledger:
    def __init__(self, db: Database) -> None:
        self.db = db
        #: run → the trainer records its incidents were made from (read once per process)
        self._recorded: dict[str, set[str]] = {}
        #: run → the save interval last recorded in its events (read once per process)
        self._interval: dict[str, int | None] = {}

    def record_observation(
        self,
        run: Run,
        attempt: Attempt,
        job: JobView,
        view: MetricsView,
        *,
        unrecorded: Sequence[CheckpointInfo],
        incidents: list[Incident],
        now: float,
    ) -> list[Recovery]:
        """What this tick saw of the run, in one transaction: the attempt's new state (and the
        run RUNNING once its job is), new checkpoints, the start-up time, and recoveries (the
        run RUNNING again once no incident is still being remedied). `attempt` and
        `incidents` are updated to match; returns the recoveries."""
        fields = attempt_update(attempt, job, now)
        first_step_s = first_step_seconds(
            fields.get("started_at", attempt.started_at), attempt, view
        )
        if first_step_s is not None:
            fields["first_step_s"] = first_step_s
        recovered = recoveries(attempt, view, incidents)
        done = {r.incident.id for r in recovered}
        left = [i for i in incidents if i.id not in done]
        back = (
            view.health is SourceHealth.UP
            and run.state is RunState.RECOVERING
            and not any(i.state is IncidentState.REMEDYING for i in left)
        )
        if not (fields or unrecorded or recovered or back):
            return []
        with self.db.write_session() as s:
            if fields:
                store.update_attempt(s, run.id, attempt.number, **fields)
                if fields.get("state") is AttemptState.RUNNING and run.state is RunState.SUBMITTED:
                    store.transition_run(
                        s,
                        run.id,
                        RunState.RUNNING,
                        expected=[RunState.SUBMITTED],
                        reason=f"job {job.job_id} running",
                        attempt=attempt.number,
                    )
            _record_checkpoints(s, run.id, unrecorded)
            for r in recovered:
                store.update_incident(
                    s,
                    r.incident.id,
                    state=IncidentState.RECOVERED,
                    recovered_ts=as_datetime(r.recovered_t),
                    steps_lost=r.steps_lost,
                )
            if back:
                store.transition_run(
                    s,
                    run.id,
                    RunState.RUNNING,
                    expected=[RunState.RECOVERING],
                    reason="training progresses again",
                    attempt=attempt.number,
                )
        for k, v in fields.items():
            setattr(attempt, k, v)
        incidents[:] = left
        return recovered

    def record_progress(self, progress: dict[str, dict[str, Any]]) -> None:
        """The tick's observed progress of every run that moved, in one transaction."""
        if progress:
            with self.db.write_session() as s:
                store.set_progress(s, progress)

    def record_checkpoints(self, run: Run, unrecorded: Sequence[CheckpointInfo]) -> None:
        """Checkpoints found on disk that the database does not list yet."""
        if unrecorded:
            with self.db.write_session() as s:
                _record_checkpoints(s, run.id, unrecorded)

    def record_incident(
        self,
        run: Run,
        attempt: Attempt,
        remedy: Remedy,
        incidents: list[Incident],
        step: int | None,
        disk_step: int | None,
        now: float,
    ) -> tuple[int, bool]:
        """The run's open incident (one fault may need several remedies) with this remedy
        recorded, or a new one opened with it, in one transaction; (its id, opened now)."""
        finding = remedy.finding
        assert finding is not None
        state = (
            IncidentState.ESCALATED
            if remedy.kind is RemedyKind.ESCALATE
            else IncidentState.REMEDYING
        )
        resume_from = remedy.to_step if remedy.to_step is not None else disk_step
        evidence = {
            "finding": finding.summary,
            "cause": finding.cause.value,
            "suspect": remedy.suspect.value,
            "last_healthy_step": finding.last_healthy_step,
            "first_bad_step": finding.first_bad_step,
            "sample_window": list(finding.sample_window) if finding.sample_window else None,
            "nodes": list(finding.nodes),
            "step": step,
            "resume_from": resume_from,
            "remedy_attempt": attempt.number,
            "remedies": [remedy.kind.value],
            **{k: v for k, v in finding.evidence.items() if _jsonable(v)},
        }
        if incidents:
            # One fault, several remedies: keep the original onset, record the latest remedy.
            incident = incidents[-1]
            old = incident.evidence_json or {}
            merged = {**evidence, **{k: v for k, v in old.items() if v is not None}}
            merged.update(
                resume_from=resume_from,
                remedy_attempt=attempt.number,
                step=max((x for x in (old.get("step"), step) if x is not None), default=None),
                remedies=[*old.get("remedies", []), remedy.kind.value],
            )
            with self.db.write_session() as s:
                store.update_incident(
                    s, incident.id, remedy=remedy.kind.value, state=state, evidence_json=merged
                )
            return incident.id, False
        fault_ts = finding.fault_time if finding.fault_time is not None else now
        with self.db.write_session() as s:
            incident = store.open_incident(
                s,
                run.id,
                attempt.number,
                finding.kind.value,
                evidence=evidence,
                fault_ts=as_datetime(fault_ts),
            )
            store.update_incident(s, incident.id, remedy=remedy.kind.value, state=state)
        incidents.append(incident)
        return incident.id, True

    def record_contained(self, run: Run, attempt: int, found: Sequence[Episode]) -> int:
        """Contained episodes of the trainer's record not yet written down, each as one
        incident with its evidence, over as soon as recorded (no remedy, 0 steps lost), once
        (keyed by its first record). Returns how many were written."""
        if not found:
            return 0
        recorded = self._recorded.get(run.id)
        if recorded is None:
            with self.db.session() as s:
                recorded = store.recorded_incident_keys(s, run.id, [FindingKind.CONTAINED.value])
            self._recorded[run.id] = recorded
        new = [e for e in found if e.key not in recorded]
        if not new:
            return 0
        with self.db.write_session() as s:
            for e in new:
                incident = store.open_incident(
                    s, run.id, attempt, FindingKind.CONTAINED.value,
                    evidence=episode_evidence(e), fault_ts=as_datetime(e.records[0].t),
                )  # fmt: skip
                store.update_incident(
                    s, incident.id, state=IncidentState.RECOVERED, remedy=RemedyKind.NONE.value,
                    recovered_ts=as_datetime(e.records[-1].t), steps_lost=0,
                )  # fmt: skip
        recorded.update(e.key for e in new)
        return len(new)

    def record_interval(self, run: Run, attempt: int, timing: SaveTiming | None) -> bool:
        """A change of the interval the trainer saves at (`checkpoint.interval_auto`), as one
        checkpoint event with the save it was sized by; once per change, also across a
        supervisor restart (the newest such event is read back on first sight)."""
        if timing is None or not timing.interval_steps:
            return False
        if run.id not in self._interval:
            with self.db.session() as s:
                self._interval[run.id] = store.last_checkpoint_interval(s, run.id)
        if self._interval[run.id] == timing.interval_steps:
            return False
        with self.db.write_session() as s:
            store.add_event(
                s, run.id, EventKind.CHECKPOINT,
                f"checkpoint interval {timing.interval_steps} steps (save cost "
                f"{timing.stall_seconds:.2f} s, step {timing.step_seconds:.3f} s, at step "
                f"{timing.step})",
                attempt=attempt,
                data={"interval_steps": timing.interval_steps, "save_step": timing.step,
                      "stall_seconds": timing.stall_seconds, "step_seconds": timing.step_seconds},
            )  # fmt: skip
        self._interval[run.id] = timing.interval_steps
        return True

    def forget(self, run_id: str) -> None:
        self._recorded.pop(run_id, None)
        self._interval.pop(run_id, None)

    def close_incidents(self, incidents: Sequence[Incident], now: float) -> None:
        """The run reached its target with incidents whose recovery was never scraped (a short
        attempt can end between scrapes): dated now, steps lost from the remedy's evidence."""
        if not incidents:
            return
        with self.db.write_session() as s:
            for incident in incidents:
                ev = incident.evidence_json or {}
                store.update_incident(
                    s,
                    incident.id,
                    state=IncidentState.RECOVERED,
                    recovered_ts=incident.recovered_ts or as_datetime(now),
                    steps_lost=accounting.steps_lost(ev.get("step"), ev.get("resume_from")),
                )


def episode_evidence(episode: Episode) -> dict[str, Any]:
    """A contained episode's incident evidence (pure): the steps, samples, nodes, losses."""
    records = episode.records
    return {
        "finding": f"trainer: {episode.kind} at steps {episode.first}-{episode.last} (contained)",
        "record": episode.key,
        "episode": episode.kind,
        "cause": Cause.NODE.value if episode.nodes and not episode.samples else Cause.DATA.value,
        "first_bad_step": episode.first,
        "last_healthy_step": episode.first - 1,
        "steps": [a.step for a in records],
        "bad_samples": [list(r) for r in episode.samples],
        "nodes": list(episode.nodes),
        "losses": [a.loss for a in records],
        "updates_skipped": sum(a.update_skipped for a in records),
        "remedies": [],
    }


def _record_checkpoints(s: Session, run_id: str, infos: Sequence[CheckpointInfo]) -> None:
    for c in infos:
        store.record_checkpoint(
            s,
            run_id,
            step=c.step,
            consumed_samples=c.consumed_samples,
            loss=c.loss,
            path=str(c.path),
            saved_at=as_datetime(c.saved_at),
            complete=c.complete,
        )


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))
