"""Observe: read the world for one tick, in batches, into one snapshot per run; write nothing.

The tick's reads are batched per source, whatever the number of runs: one query per table for
every watched run (runs, current attempts, unfinished intents, open incidents, checkpoints
already recorded, the slowest start-up seen), ONE SLURM poll for all current jobs and one
metrics collection for all runs. What only one run's path needs (its checkpoints on disk, the
blame in a failed job's log, the history a remedy is chosen from) is read when that run gets
there, because reading it for a run that ends its tick earlier would be wasted.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session, defer

from contracts import exitcodes
from contracts.anomalies import Anomaly, ledger_path
from contracts.anomalies import parse as parse_anomalies
from contracts.checkpoints import (
    SAVE_TIMING_PATH,
    CheckpointInfo,
    SaveTiming,
    list_checkpoints,
    read_save_timing,
)
from contracts.paths import attempt_log_dir, checkpoint_dir, run_dir
from contracts.restart import (
    all_checkpointed,
    all_finished_at,
    exit_records,
    failed_exit,
    job_control_dir,
    read_order,
)
from contracts.spec import RunSpec
from supervisor import store
from supervisor.db import Database
from supervisor.metrics_in import MetricSource, MetricsView, SourceHealth
from supervisor.models import (
    ACTIVE_RUN_STATES,
    Action,
    ActionState,
    Attempt,
    AttemptState,
    Checkpoint,
    Incident,
    IncidentState,
    Node,
    Run,
    RunState,
)
from supervisor.slurm import Cluster, JobState, JobStatus, SourceUnavailable, tail
from supervisor.watchdog.actions import ROLLS_BACK, ActionKind
from supervisor.watchdog.blame import LogCause, log_cause
from supervisor.watchdog.policy import trusted_checkpoints
from supervisor.watchdog.reserves import Reserve
from supervisor.watchdog.snapshot import (
    CheckpointRef,
    FindingKind,
    JobView,
    PastRemedy,
    RemedyKind,
    RunHistory,
)

log = logging.getLogger("nightwatch.watchdog")

#: How long SLURM may go on running a job whose ranks all finished before the attempt counts
#: as COMPLETED anyway (`Observer.ranks_ended`): a job ends a second or two after its ranks.
LINGER_S = 10.0
#: Actions resumed from their intent after a crash (cancel / complete are re-derived each tick).
RESUMABLE = [ActionKind.SUBMIT.value] + [k.value for k in RemedyKind if k is not RemedyKind.NONE]


@dataclass
class World:
    """Everything one tick read in batches (the runs' rows are detached: read-only)."""

    pending: list[Run]
    watched: list[Run]
    attempts: dict[str, Attempt]  # run → its current attempt
    unfinished: dict[str, Action]  # run → its oldest resumable intent
    incidents: dict[str, list[Incident]]  # run → its open or remedying incidents
    recorded_step: dict[str, int]  # run → newest checkpoint step already recorded
    startup_seen: dict[str, float]  # run → slowest start → first step of its attempts (s)
    reserves: dict[str, list[Reserve]]  # run → the reserve jobs of its current job
    fleet_excluded: frozenset[str]  # nodes an operator took out of the fleet
    statuses: dict[str, JobStatus] = field(default_factory=dict)
    views: dict[tuple[str, int], MetricsView] = field(default_factory=dict)
    slurm_up: bool = True
    metrics_up: bool = True
    phases: dict[str, float] = field(default_factory=dict)

    def status(self, attempt: Attempt | None) -> JobStatus | None:
        return self.statuses.get(attempt.job_id) if attempt and attempt.job_id else None

    def view(self, run: Run) -> MetricsView:
        return self.views.get((run.id, run.current_attempt), MetricsView(SourceHealth.MISSING))


@dataclass(frozen=True)
class Disk:
    """A run's checkpoints on disk: the complete ones a resume may use, and every one not yet
    recorded in the database."""

    checkpoints: list[CheckpointRef]
    unrecorded: list[CheckpointInfo]

    @property
    def step(self) -> int | None:
        return self.checkpoints[-1].step if self.checkpoints else None


class Observer:
    """The tick's reads. Caches only what cannot change: parsed specs and the blame in a
    failed attempt's log, both pruned to the runs still watched."""

    def __init__(self, db: Database, cluster: Cluster, source: MetricSource, home: Path) -> None:
        self.db = db
        self.cluster = cluster
        self.source = source
        self.home = home
        self._specs: dict[str, RunSpec] = {}
        self._log_causes: dict[tuple[str, int], LogCause] = {}
        #: run → (the trainer's record file's size and mtime, its records)
        self._anomalies: dict[str, tuple[tuple[int, int], list[Anomaly]]] = {}
        #: run → (its save-timing file's mtime, the timing)
        self._timings: dict[str, tuple[int, SaveTiming | None]] = {}

    def read_db(self) -> World:
        """The database's part of the world: one query per table for every run."""
        with self.db.session() as s:
            pending = list(store.runs_in_states(s, [RunState.PENDING]))
            watched = _watched_runs(s)
            ids = [r.id for r in watched]
            world = World(
                pending=pending,
                watched=watched,
                attempts=_current_attempts(s, [*pending, *watched]),
                unfinished=_unfinished_actions(s, ids),
                incidents=_open_incidents(s, ids),
                recorded_step=_recorded_steps(s, ids),
                startup_seen=_startup_seen(s, ids),
                reserves=_reserves(s, watched),
                fleet_excluded=frozenset(store.fleet_excluded_nodes(s)),
            )
        current = {(r.id, r.current_attempt) for r in watched}
        self._log_causes = {k: v for k, v in self._log_causes.items() if k in current}
        keep = {r.id for r in [*pending, *watched]}
        self._specs = {k: v for k, v in self._specs.items() if k in keep}
        self._anomalies = {k: v for k, v in self._anomalies.items() if k in keep}
        self._timings = {k: v for k, v in self._timings.items() if k in keep}
        return world

    def read_sources(
        self, world: World, now: float, probe: Collection[tuple[str, int]] = ()
    ) -> None:
        """One SLURM poll for every current job, one metrics collection for every active run
        (reading the endpoints of the `probe` runs now: `MetricSource.collect`).
        A source that fails reads as down, never as healthy."""
        watched_ids = {r.id for r in world.watched}
        job_ids = [a.job_id for k, a in world.attempts.items() if a.job_id and k in watched_ids]
        job_ids += [r.job_id for rs in world.reserves.values() for r in rs if r.job_id]
        try:
            mark = time.perf_counter()
            world.statuses = self.cluster.poll(job_ids)
            world.phases["slurm"] = time.perf_counter() - mark
        except SourceUnavailable as exc:
            log.warning(f"SLURM poll failed: {exc}")
            world.statuses, world.slurm_up = {}, False
        active = [r for r in world.watched if r.state is not RunState.NEEDS_ATTENTION]
        keys = [(r.id, r.current_attempt) for r in active]
        try:
            mark = time.perf_counter()
            world.views = self.source.collect(keys, now, probe=[k for k in keys if k in probe])
            world.phases["metrics"] = time.perf_counter() - mark
        except Exception as exc:  # a source bug must read as "down", never as "healthy"
            log.warning(f"metrics source failed: {exc}")
            world.views = {k: MetricsView(SourceHealth.DOWN, error=str(exc)) for k in keys}
        world.metrics_up = not keys or any(
            v.health is not SourceHealth.DOWN for v in world.views.values()
        )

    def spec(self, run: Run) -> RunSpec:
        spec = self._specs.get(run.id)
        if spec is None:
            with self.db.session() as s:
                raw = s.scalar(select(Run.spec_json).where(Run.id == run.id))
            spec = self._specs[run.id] = RunSpec.model_validate(raw)
        return spec

    def disk(self, run: Run, spec: RunSpec, recorded_step: int | None) -> Disk:
        """Checkpoints on disk (oldest first); after a rollback only the trusted ones."""
        infos = list_checkpoints(checkpoint_dir(self.home, run.id, spec))
        known = -1 if recorded_step is None else recorded_step
        refs = [
            CheckpointRef(step=c.step, saved_at=c.saved_at, consumed_samples=c.consumed_samples)
            for c in sorted(infos, key=lambda c: c.step)
            if c.complete
        ]
        if run.resume_step is not None:  # rolled back once: later checkpoints may be tainted
            refs = trusted_checkpoints(refs, self._rollbacks(run.id))
        return Disk(refs, [c for c in infos if c.step > known])

    def anomalies(self, run: Run, spec: RunSpec) -> list[Anomaly]:
        """The trainer's records of the run's bad steps (all attempts), re-read only when the
        file changed: one stat a tick for a run that has none."""
        path = ledger_path(checkpoint_dir(self.home, run.id, spec))
        try:
            st = path.stat()
        except OSError:
            return []
        stamp = (st.st_size, st.st_mtime_ns)
        cached = self._anomalies.get(run.id)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            records = parse_anomalies(path.read_text())
        except OSError:
            return cached[1] if cached else []
        self._anomalies[run.id] = (stamp, records)
        return records

    def evidence_files(self, run: Run, attempt: Attempt, spec: RunSpec) -> tuple[Path, ...]:
        """What changes the moment the attempt goes wrong: the trainer's record of bad steps,
        and (restarts inside the job) the folder its ranks' exit codes land in (a new file
        there changes the folder's mtime). The loop between ticks watches them."""
        paths = [ledger_path(checkpoint_dir(self.home, run.id, spec))]
        if spec.recovery.restart_in_job and attempt.job_id:
            paths.append(attempt_log_dir(self.home, run.id, attempt.number) / attempt.job_id)
        return tuple(paths)

    def save_timing(self, run: Run, spec: RunSpec) -> SaveTiming | None:
        """The trainer's newest save timing (and the interval it saves at), re-read only when
        the file changed."""
        root = checkpoint_dir(self.home, run.id, spec)
        try:
            stamp = (root / SAVE_TIMING_PATH).stat().st_mtime_ns
        except OSError:
            return None
        cached = self._timings.get(run.id)
        if cached is None or cached[0] != stamp:
            cached = self._timings[run.id] = (stamp, read_save_timing(root))
        return cached[1]

    def ranks_ended(
        self, run: Run, attempt: Attempt, status: JobStatus | None, spec: RunSpec, now: float
    ) -> JobStatus | None:
        """The attempt as its ranks left it: with restarts inside the job, a job's node tasks
        outlive ranks that failed (they wait for a restart order), so SLURM still says
        RUNNING; the ranks' exit codes in the attempt's folder say the attempt failed. Ranks
        that all exited with none failing and one at least checkpointed on a stop signal
        (`all_checkpointed`) ended the attempt for a requeue (FAILED 75, as SLURM will say once
        the node tasks are gone): the next job is submitted without waiting for that.

        A job whose ranks all finished and that SLURM still runs LINGER_S after the last of
        them is held by a node it cannot reach: a job that holds spares runs `--no-kill`, and
        when the dead node was its batch host, the batch script never ends. The attempt is
        then COMPLETED (the run is done and its job is cancelled as a stray)."""
        if (
            status is None
            or status.state is not JobState.RUNNING
            or not spec.recovery.restart_in_job
            or not attempt.job_id
        ):
            return status
        folder = attempt_log_dir(self.home, run.id, attempt.number) / attempt.job_id
        records = exit_records(folder, attempt.job_id)
        finished = None
        if spec.resources.spare_nodes:  # only a --no-kill job outlives its batch host
            finished = all_finished_at(records, spec.resources.world_size)
        if finished is not None and now - finished >= LINGER_S:
            return dataclasses.replace(
                status,
                state=JobState.COMPLETED,
                exit_code=exitcodes.OK,
                reason=f"every rank finished {now - finished:.0f} s ago; the job lingers",
            )
        if all_checkpointed(records, spec.resources.world_size):
            return dataclasses.replace(
                status,
                state=JobState.FAILED,
                exit_code=exitcodes.REQUEUE,
                reason="every rank checkpointed on a stop signal (exit 75); the job is ending",
            )
        code = failed_exit([(rank, code) for _, rank, code in records])
        if code is None:
            return status
        return dataclasses.replace(
            status,
            state=JobState.FAILED,
            exit_code=code,
            reason=f"ranks failed (exit {code}); the job waits for a restart order",
        )

    def active_nodes(
        self, run: Run, attempt: Attempt, spec: RunSpec, job_nodes: Sequence[str]
    ) -> tuple[str, ...]:
        """The job's nodes that run the attempt's ranks: those its restart order named, else
        the job's first `resources.nodes`; the rest are spares (`resources.spare_nodes`)."""
        if attempt.job_id:
            order = read_order(job_control_dir(run_dir(self.home, run.id), attempt.job_id))
            if order is not None and order.attempt == attempt.number and order.nodes:
                return order.nodes
        return tuple(job_nodes[: spec.resources.nodes])

    def log_cause(
        self, run: Run, attempt: Attempt, status: JobStatus | None, view: MetricsView
    ) -> LogCause:
        """Blame from a failed job's log (read once per attempt)."""
        if status is None or status.state is not JobState.FAILED:
            return (None, None, ())
        key = (run.id, attempt.number)
        if key not in self._log_causes:
            log_dir = attempt_log_dir(self.home, run.id, attempt.number)
            try:
                files = self.cluster.log_files(status.job_id, log_dir=log_dir)
            except OSError:
                files = []
            text = "\n".join(tail(f) for f in files)
            progress = any(s.step for s in view.samples)
            nodes = status.nodes or tuple(attempt.nodes_json or ())
            self._log_causes[key] = log_cause(text, status.exit_code, progress, nodes)
        return self._log_causes[key]

    def history(
        self, run: Run, job: JobView, checkpoints: Sequence[CheckpointRef], nodes_needed: int
    ) -> RunHistory:
        """The run's past remedies and the nodes' strikes, and the spare capacity (asked only
        when a remedy is being chosen)."""
        with self.db.session() as s:
            actions = s.scalars(
                select(Action).where(Action.run_id == run.id).order_by(Action.id)
            ).all()
            nodes = s.scalars(select(Node)).all()
        strikes = {n.name: n.strikes for n in nodes}
        fleet_excluded = {n.name for n in nodes if n.excluded}  # an operator's: no spare there
        try:
            usable: list[str] | None = [
                n.name for n in self.cluster.nodes().values()
                if n.usable and n.name not in fleet_excluded
            ]  # fmt: skip
        except SourceUnavailable:
            usable = None
        return history_from_rows(
            actions,
            excluded=run.excluded_nodes_json or (),
            strikes=strikes,
            checkpoints=checkpoints,
            attempt_nodes=job.nodes,
            usable_nodes=usable,
            nodes_needed=nodes_needed,
        )

    def submitted_signal_lead(self, run_id: str, job_id: str) -> float | None:
        """The stop signal's lead the job was submitted with (its submission's recorded
        outcome), None when no submission recorded one."""
        with self.db.session() as s:
            rows = s.scalars(
                select(Action).where(
                    Action.run_id == run_id,
                    Action.kind.in_([ActionKind.SUBMIT, ActionKind.PREPARE_SUCCESSOR]),
                    Action.state == ActionState.DONE,
                )
            ).all()
        for action in rows:
            result = action.result_json or {}
            if result.get("job_id") == job_id and "signal_lead_s" in result:
                return float(result["signal_lead_s"])
        return None

    def _rollbacks(self, run_id: str) -> list[tuple[int, float | None]]:
        """(to_step, first start of any later attempt) of the run's rollbacks (and of the
        exclusions that resumed from a named step)."""
        with self.db.session() as s:
            actions = s.scalars(
                select(Action).where(
                    Action.run_id == run_id,
                    Action.kind.in_([k.value for k in ROLLS_BACK]),
                    Action.state == ActionState.DONE,
                )
            ).all()
            started = {a.number: a.started_at for a in store.get_attempts(s, run_id)}
        out = []
        for a in actions:
            to_step = (a.evidence_json or {}).get("to_step")
            if to_step is None:
                continue
            later = [t for n, t in started.items() if n > (a.attempt or 0) and t is not None]
            out.append((int(to_step), min(later).timestamp() if later else None))
        return out


def job_view(
    status: JobStatus | None,
    *,
    slurm_up: bool,
    attempt: Attempt,
    now: float,
    lost_after_s: float,
    log_cause: LogCause = (None, None, ()),
) -> JobView:
    """SLURM's answer for one attempt as the detectors see it (pure)."""
    if not slurm_up:
        return JobView(health=SourceHealth.DOWN, job_id=attempt.job_id)
    if attempt.job_id is None:
        if attempt.state is AttemptState.FAILED:
            return JobView(SourceHealth.UP, AttemptState.LOST, reason=attempt.end_reason)
        return JobView(health=SourceHealth.MISSING)
    if status is None or status.state is JobState.UNKNOWN:
        age = now - attempt.submitted_at.timestamp()
        if age > lost_after_s:
            return JobView(SourceHealth.UP, AttemptState.LOST, job_id=attempt.job_id)
        return JobView(health=SourceHealth.MISSING, job_id=attempt.job_id)
    cause, reason, hosts = log_cause
    nodes = status.nodes
    if status.completing and attempt.nodes_json:
        # squeue lists a COMPLETING job on the nodes still tearing down, not on all of its own
        nodes = tuple(attempt.nodes_json)
    return JobView(
        health=SourceHealth.UP,
        state=status.state.attempt_state,
        job_id=status.job_id,
        nodes=nodes,
        exit_code=status.exit_code,
        reason=reason or status.reason or None,
        failed_nodes=status.failed_nodes or hosts,
        cause=cause,
        completing=status.completing,
        time_left_s=status.time_left_s,
    )


def history_from_rows(
    actions: Iterable[Action],
    *,
    excluded: Iterable[str],
    strikes: dict[str, int],
    checkpoints: Sequence[CheckpointRef],
    attempt_nodes: Sequence[str],
    usable_nodes: Iterable[str] | None = None,
    nodes_needed: int = 1,
) -> RunHistory:
    """The policy's view of the past, rebuilt from the actions' recorded evidence (pure).
    Remedies whose resubmission failed are kept (marked `failed`): they count against the
    restart budget, or a submission that keeps failing would be retried forever."""
    remedies = []
    kinds = {k.value for k in RemedyKind}
    for a in actions:
        if a.kind not in kinds:
            continue
        ev = a.evidence_json or {}
        remedies.append(
            PastRemedy(
                kind=RemedyKind(a.kind),
                attempt=a.attempt or 0,
                at=a.created_at.timestamp(),
                finding_kind=_finding_kind(ev.get("finding_kind")),
                step=ev.get("step"),
                skip_ranges=tuple(tuple(r) for r in ev.get("skip_ranges", ())),  # type: ignore[misc]
                excluded=tuple(ev.get("exclude_nodes", ())),
                attempt_nodes=tuple(ev.get("attempt_nodes", ())),
                incident_id=ev.get("incident_id"),
                finding_nodes=tuple(ev.get("finding_nodes", ())),
                failed=a.state is ActionState.FAILED,
            )
        )
    return RunHistory(
        remedies=tuple(remedies),
        excluded_nodes=frozenset(excluded),
        node_strikes=dict(strikes),
        checkpoints=tuple(checkpoints),
        attempt_nodes=tuple(attempt_nodes),
        usable_nodes=frozenset(usable_nodes) if usable_nodes is not None else None,
        nodes_needed=nodes_needed,
    )


def _finding_kind(value: Any) -> FindingKind | None:
    try:
        return FindingKind(value) if value else None
    except ValueError:
        return None


def ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def as_datetime(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


# ---------------------------------------------------------------- batched queries


def _watched_runs(session: Session) -> list[Run]:
    """Active and needs-attention runs, without their spec (parsed once, see `spec`)."""
    states = [*ACTIVE_RUN_STATES, RunState.NEEDS_ATTENTION]
    return list(
        session.scalars(
            select(Run).options(defer(Run.spec_json)).where(Run.state.in_(states))
        ).all()
    )


def _reserves(session: Session, runs: Sequence[Run]) -> dict[str, list[Reserve]]:
    """Run → the reserve jobs recorded for its current attempt's job (oldest first)."""
    if not runs:
        return {}
    current = and_(Attempt.run_id == Run.id, Attempt.number == Run.current_attempt)
    rows = session.execute(
        select(
            Action.run_id,
            Action.target,
            Action.state,
            Action.attempt,
            Action.evidence_json,
            Action.result_json,
            Action.created_at,
            Attempt.job_id,
        )
        .join(Run, Run.id == Action.run_id)
        .join(Attempt, current)
        .where(
            Action.run_id.in_([r.id for r in runs]),
            Action.kind == ActionKind.RESERVE.value,
        )
        .order_by(Action.id)
    ).all()
    out: dict[str, list[Reserve]] = {}
    for row in rows:
        if row.job_id is not None and row.evidence_json.get("job_id") == row.job_id:
            reserve = Reserve.from_action(
                row.target, row.state, row.attempt, row.evidence_json, row.result_json,
                ts(row.created_at) or 0.0,
            )  # fmt: skip
            out.setdefault(row.run_id, []).append(reserve)
    return out


def _current_attempts(session: Session, runs: Sequence[Run]) -> dict[str, Attempt]:
    if not runs:
        return {}
    rows = session.scalars(
        select(Attempt)
        .options(defer(Attempt.skip_ranges_json), defer(Attempt.exclude_json))
        .join(Run, Run.id == Attempt.run_id)
        .where(Attempt.run_id.in_([r.id for r in runs]), Attempt.number == Run.current_attempt)
    ).all()
    return {a.run_id: a for a in rows}


def _unfinished_actions(session: Session, run_ids: Sequence[str]) -> dict[str, Action]:
    if not run_ids:
        return {}
    rows = session.scalars(
        select(Action)
        .where(
            Action.state == ActionState.INTENT,
            Action.run_id.in_(run_ids),
            Action.kind.in_(RESUMABLE),
        )
        .order_by(Action.id)
    ).all()
    out: dict[str, Action] = {}
    for a in rows:
        out.setdefault(a.run_id, a)
    return out


def _open_incidents(session: Session, run_ids: Sequence[str]) -> dict[str, list[Incident]]:
    if not run_ids:
        return {}
    rows = session.scalars(
        select(Incident)
        .where(
            Incident.run_id.in_(run_ids),
            Incident.state.in_([IncidentState.OPEN, IncidentState.REMEDYING]),
        )
        .order_by(Incident.id)
    ).all()
    out: dict[str, list[Incident]] = {}
    for i in rows:
        out.setdefault(i.run_id, []).append(i)
    return out


def _recorded_steps(session: Session, run_ids: Sequence[str]) -> dict[str, int]:
    if not run_ids:
        return {}
    rows = session.execute(
        select(Checkpoint.run_id, func.max(Checkpoint.step))
        .where(Checkpoint.run_id.in_(run_ids))
        .group_by(Checkpoint.run_id)
    ).all()
    return {run_id: int(step) for run_id, step in rows}


def _startup_seen(session: Session, run_ids: Sequence[str]) -> dict[str, float]:
    """The slowest start → first step of each run's attempts (only those that took time)."""
    if not run_ids:
        return {}
    rows = session.execute(
        select(Attempt.run_id, func.max(Attempt.first_step_s))
        .where(Attempt.run_id.in_(run_ids), Attempt.first_step_s > 0)
        .group_by(Attempt.run_id)
    ).all()
    return {run_id: float(took) for run_id, took in rows}
