"""The reconcile loop: every tick, for every active run, observe → detect → decide → act.

Level-triggered: each tick recomputes from actual state — the database, ONE batched SLURM
poll for all current jobs, one metrics collection for all runs, checkpoints on disk — so
nothing depends on having seen an event, and a restarted supervisor picks up where the world
is. One actor at a time: a tick only acts while this replica holds the `leases` row (a
compare-and-set with expiry on the database's clock), renewed as the tick goes on and checked
by every side effect against its epoch (supervisor.watchdog.lease). An action whose intent
survived a crash is resumed before anything new is decided for that run, and whatever a crash
left running that no run may have is cancelled (supervisor.watchdog.strays).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from sqlalchemy import func, select
from sqlalchemy.orm import defer

from contracts import exitcodes
from contracts.spec import RunSpec
from supervisor import store
from supervisor.db import Database
from supervisor.launcher import JOB_PREFIX, NodeSetup
from supervisor.metrics import SupervisorMetrics
from supervisor.models import (
    ACTIVE_RUN_STATES,
    Action,
    ActionState,
    Attempt,
    AttemptState,
    Incident,
    IncidentState,
    Node,
    NodeHealth,
    Run,
    RunState,
)
from supervisor.prometheus import MetricSource, PrometheusSource, ScrapeSource, Target
from supervisor.settings import Settings
from supervisor.slurm import Cluster, JobState, JobStatus, SourceUnavailable, make_cluster, tail
from supervisor.slurm.joblogs import LogFinding, LogKind, classify, suspect_hosts
from supervisor.watchdog import accounting, strays
from supervisor.watchdog.actions import (
    ROLLS_BACK,
    ActContext,
    ActionKind,
    Actuator,
    ActuatorConfig,
    attempt_log_dir,
    checkpoint_dir,
)
from supervisor.watchdog.detectors import (
    detect_all,
    median_step_time,
)
from supervisor.watchdog.lease import Deposed, LeaseGuard
from supervisor.watchdog.notify import Notifier
from supervisor.watchdog.policy import (
    backoff_seconds,
    decide,
    restarts_in_window,
    trusted_checkpoints,
)
from supervisor.watchdog.snapshot import (
    Cause,
    CheckpointRef,
    Finding,
    FindingKind,
    JobView,
    MetricsView,
    PastRemedy,
    Remedy,
    RemedyKind,
    RunHistory,
    Snapshot,
    SourceHealth,
)
from supervisor.watchdog.telemetry import WatchdogMetrics

log = logging.getLogger("nightwatch.watchdog")

#: Seconds between refreshes of a run's ETTR gauge, and how many runs one tick refreshes. Each
#: refresh is three DB reads (`benchmarks/reconcile_scale.py`, 1,000 runs: 50 a tick gave a
#: steady tick of 1.0-1.2 s against 0.84-0.95 s; 10 a tick, a runs phase of 0.13-0.15 s against
#: 0.13-0.20 s, within noise), so a large fleet's refreshes are spread thin: 1,000 runs take
#: 100 ticks to go round, a handful of runs refresh every 30 s.
ETTR_REFRESH_S = 30.0
ETTR_REFRESHES_PER_TICK = 10

#: Actions resumed from their intent after a crash (cancel / complete are re-derived each tick).
_RESUMABLE = [ActionKind.SUBMIT.value] + [k.value for k in RemedyKind if k is not RemedyKind.NONE]


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class WatchdogConfig:
    home: Path
    supervisor_url: str | None = None
    tick_seconds: float = 5.0
    lease_name: str = "reconciler"
    lease_ttl_s: float = 30.0
    lost_after_s: float = 300.0
    node_setup: NodeSetup = field(default_factory=NodeSetup)
    signal_delay_s: int = 90
    holder: str = field(default_factory=default_holder)


@dataclass
class TickResult:
    """What one tick saw and did (for tests, the demo and the benchmark)."""

    leader: bool
    runs: int = 0
    duration_s: float = 0.0
    slurm_up: bool = True
    metrics_up: bool = True
    findings: dict[str, list[Finding]] = field(default_factory=dict)
    remedies: dict[str, Remedy] = field(default_factory=dict)
    submitted: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of the tick
    cpu_s: float = 0.0  # CPU time of this process during the tick (robust on a busy machine)
    ettr_refreshes: int = 0


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
    )


LogCause = tuple[Cause | None, str | None, tuple[str, ...]]  # cause, log line, named nodes

#: What a rank logs when a PEER died (gloo/NCCL): the address it names is the reporting
#: side's view of the dead peer (127.0.0.1 on one host), so it blames the rank that crashed.
_PEER_CLOSED = re.compile(r"Connection (?:closed|reset) by peer", re.IGNORECASE)
_IPV4 = re.compile(r"\d+\.\d+\.\d+\.\d+")


def node_names(hosts: Iterable[str], nodes: Sequence[str]) -> tuple[str, ...]:
    """Hosts named in a log as the attempt's SLURM node names (pure): exact or short-name
    match (`gpu13.cluster` → `gpu13`); anything else (an address, a host outside the
    attempt) is dropped, because excluding it makes every resubmission fail with sbatch's
    `Invalid node name specified`."""
    out: list[str] = []
    for host in hosts:
        short = host if _IPV4.fullmatch(host) else host.split(".")[0]
        name = host if host in nodes else short if short in nodes else None
        if name is not None and name not in out:
            out.append(name)
    return tuple(out)


def crashed_hosts(findings: Sequence[LogFinding]) -> list[str]:
    """Hosts of the tasks that died on their own: killed by a signal or exited with a code
    other than 1 (a peer that lost them raises and exits 1); else the first task srun saw end."""
    exits = [f for f in findings if f.kind is LogKind.TASK_EXIT and f.host]
    own = [f for f in exits if f.exit_code not in (0, 1)]
    return list(dict.fromkeys(f.host for f in own or exits[:1] if f.host))


def log_cause(
    text: str, exit_code: int | None, made_progress: bool, nodes: Sequence[str] = ()
) -> LogCause:
    """Blame from a failed job's log (pure), naming only the attempt's nodes (`nodes`):
    collective errors name a faulty node; a peer's "connection closed" and a killed or
    crashed rank are a plain crash of that rank's node (restart, exclusion only when it
    recurs there); an exception before the first step is a program error."""
    findings = classify(text)
    kinds = {f.kind for f in findings}
    first = findings[-1].line if findings else None
    crashed = node_names(crashed_hosts(findings), nodes)
    if exit_code == exitcodes.REQUEUE:
        return Cause.INFRA, first, ()
    collective = {LogKind.COLLECTIVE_ERROR, LogKind.NODE_FAILURE}
    peer_lost = any(f.kind in collective and _PEER_CLOSED.search(f.line) for f in findings)
    blaming = [f for f in findings if f.kind in collective and not _PEER_CLOSED.search(f.line)]
    if blaming:
        return Cause.NODE, first, node_names(suspect_hosts(blaming), nodes)
    if LogKind.OUT_OF_MEMORY in kinds:
        return Cause.CODE, first, ()
    if peer_lost or exit_code == exitcodes.INJECTED_CRASH:
        return Cause.UNKNOWN, first, crashed
    if LogKind.PYTHON_EXCEPTION in kinds and not made_progress:
        return Cause.CODE, first, ()
    return Cause.UNKNOWN if findings else None, first, crashed


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
        finding_kind = ev.get("finding_kind")
        remedies.append(
            PastRemedy(
                kind=RemedyKind(a.kind),
                attempt=a.attempt or 0,
                at=a.created_at.timestamp(),
                finding_kind=_finding_kind(finding_kind),
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


class Reconciler:
    def __init__(
        self,
        db: Database,
        cluster: Cluster,
        source: MetricSource,
        config: WatchdogConfig,
        *,
        registry: CollectorRegistry | None = None,
        supervisor_metrics: SupervisorMetrics | None = None,
        notifier: Notifier | None = None,
        clock: Any = time.time,
    ) -> None:
        self.db = db
        self.cluster = cluster
        self.source = source
        self.config = config
        self.clock = clock
        self.notifier = notifier or Notifier(None)
        self.registry = registry or CollectorRegistry()
        self.metrics = WatchdogMetrics(self.registry)
        self.supervisor_metrics = supervisor_metrics
        self.lease = LeaseGuard(db, config.lease_name, config.holder, config.lease_ttl_s)
        self.actuator = Actuator(
            db,
            cluster,
            ActuatorConfig(
                home=config.home,
                supervisor_url=config.supervisor_url,
                node_setup=config.node_setup,
                signal_delay_s=config.signal_delay_s,
            ),
            self.notifier,
            self.lease,
        )
        self._specs: dict[str, RunSpec] = {}
        self._known_ckpt: dict[str, int] = {}
        self._ckpt_dirs: dict[str, Path] = {}
        self._log_causes: dict[tuple[str, int], LogCause] = {}
        self._startup_seen: dict[str, float] = {}  # run → slowest start → first step (s)
        self._startup_noted: dict[str, int] = {}  # run → last attempt measured
        self._ettr_exported: dict[str, float] = {}  # run → when its ETTR gauge was last set
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ loop

    def start(self) -> threading.Thread:
        """Run ticks in a background thread until `stop()` (the API's lifespan owns it)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self.run_forever, name="reconciler", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run_forever(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:  # one bad tick must not kill the supervisor
                log.exception("tick failed")
            self._stop.wait(max(0.0, self.config.tick_seconds - (time.monotonic() - started)))

    # ------------------------------------------------------------------ tick

    def tick(self) -> TickResult:
        started = time.perf_counter()
        cpu_started = time.process_time()
        now = self.clock()
        result = TickResult(leader=self.lease.acquire())
        if not result.leader:
            return result
        self.notifier.wake()  # the leader sends what is due, an earlier process's too
        try:
            self._tick(result, now)
        except Deposed as exc:  # another replica acts now; what this one began, it resumes
            log.warning(f"{exc}: this replica stops acting")
            result.leader = False
        result.duration_s = time.perf_counter() - started
        result.cpu_s = time.process_time() - cpu_started
        self._export(result, now)
        return result

    def _tick(self, result: TickResult, now: float) -> None:
        with self.db.session() as s:
            pending = list(store.runs_in_states(s, [RunState.PENDING]))
            watched = self._watched_runs(s)
            attempts = self._current_attempts(s, [*pending, *watched])
            unfinished = self._unfinished_actions(s, [r.id for r in watched])
            incidents = self._open_incidents(s, [r.id for r in watched])
        for run in pending:
            try:
                self.lease.keep()
                attempt = attempts.pop(run.id, None)
                if run.cancel_requested:  # after a failed or cut-off submission
                    job_id = attempt.job_id if attempt else None
                    self.actuator.cancel_run(run.id, run.current_attempt, job_id, True)
                else:
                    self._submit_first(run, attempt, result, now)
            except Deposed:
                raise
            except Exception as exc:
                log.exception("submit failed", extra={"run_id": run.id})
                result.errors[run.id] = f"{type(exc).__name__}: {exc}"
        job_ids = [a.job_id for a in attempts.values() if a.job_id]
        try:
            mark = time.perf_counter()
            statuses = self.cluster.poll(job_ids)
            result.phases["slurm"] = time.perf_counter() - mark
        except SourceUnavailable as exc:
            log.warning(f"SLURM poll failed: {exc}")
            statuses, result.slurm_up = {}, False
        active = [r for r in watched if r.state is not RunState.NEEDS_ATTENTION]
        keys = [(r.id, r.current_attempt) for r in active]
        try:
            mark = time.perf_counter()
            views = self.source.collect(keys, now)
            result.phases["metrics"] = time.perf_counter() - mark
        except Exception as exc:  # a source bug must read as "down", never as "healthy"
            log.warning(f"metrics source failed: {exc}")
            views = {k: MetricsView(SourceHealth.DOWN, error=str(exc)) for k in keys}
        result.metrics_up = not keys or any(
            v.health is not SourceHealth.DOWN for v in views.values()
        )
        mark = time.perf_counter()
        for run in watched:
            attempt = attempts.get(run.id)
            try:
                self.lease.keep()
                self._reconcile(
                    run,
                    attempt,
                    statuses.get(attempt.job_id) if attempt and attempt.job_id else None,
                    views.get((run.id, run.current_attempt), MetricsView(SourceHealth.MISSING)),
                    unfinished.get(run.id),
                    incidents.get(run.id, []),
                    now,
                    result,
                )
            except Deposed:
                raise
            except Exception as exc:
                log.exception("reconcile failed", extra={"run_id": run.id})
                result.errors[run.id] = f"{type(exc).__name__}: {exc}"
        result.runs = len(watched)
        result.phases["runs"] = time.perf_counter() - mark
        self._cancel_strays()

    def _cancel_strays(self) -> None:
        """Cancel the live jobs no run may have (one listing a tick; skipped while SLURM
        does not answer)."""
        try:
            live = self.cluster.live_jobs(JOB_PREFIX)
        except SourceUnavailable as exc:
            log.warning(f"listing live jobs failed: {exc}")
            return
        with self.db.session() as s:
            runs = strays.load_runs(s, live.values())
        for stray in strays.find_strays(live, runs):
            self.actuator.cancel_stray(stray.run_id, stray.attempt, stray.job_id, stray.reason)
        with self.db.session() as s:
            leftovers = strays.unfinished_on_ended_runs(s)
        for key, kind, target in leftovers:
            if kind != ActionKind.CANCEL.value or target not in live:
                self.actuator.close_leftover(key, kind, target)

    def _export(self, result: TickResult, now: float) -> None:
        m = self.metrics
        m.tick_duration.observe(result.duration_s)
        m.last_tick.set(now)
        m.source_up.labels(source="slurm").set(1 if result.slurm_up else 0)
        m.source_up.labels(source=self.source.name).set(1 if result.metrics_up else 0)
        with self.db.session() as s:
            excluded = s.scalar(
                select(func.count()).select_from(Node).where(Node.health == NodeHealth.EXCLUDED)
            )
            m.excluded_nodes.set(excluded or 0)
            watched = store.run_states(s, [*ACTIVE_RUN_STATES, RunState.NEEDS_ATTENTION])
            m.set_needs_attention(
                {run_id: state is RunState.NEEDS_ATTENTION for run_id, state in watched.items()}
            )
            if self.supervisor_metrics is not None:
                self.supervisor_metrics.set_run_counts(store.count_runs_by_state(s))

    # ------------------------------------------------------------------ batched reads

    @staticmethod
    def _watched_runs(session: Any) -> list[Run]:
        """Active and needs-attention runs, without their spec (parsed once, see `_spec`)."""
        states = [*ACTIVE_RUN_STATES, RunState.NEEDS_ATTENTION]
        return list(
            session.scalars(
                select(Run).options(defer(Run.spec_json)).where(Run.state.in_(states))
            ).all()
        )

    @staticmethod
    def _current_attempts(session: Any, runs: Sequence[Run]) -> dict[str, Attempt]:
        if not runs:
            return {}
        rows = session.scalars(
            select(Attempt)
            .options(defer(Attempt.skip_ranges_json), defer(Attempt.exclude_json))
            .join(Run, Run.id == Attempt.run_id)
            .where(Attempt.run_id.in_([r.id for r in runs]), Attempt.number == Run.current_attempt)
        ).all()
        return {a.run_id: a for a in rows}

    @staticmethod
    def _unfinished_actions(session: Any, run_ids: Sequence[str]) -> dict[str, Action]:
        if not run_ids:
            return {}
        rows = session.scalars(
            select(Action)
            .where(
                Action.state == ActionState.INTENT,
                Action.run_id.in_(run_ids),
                Action.kind.in_(_RESUMABLE),
            )
            .order_by(Action.id)
        ).all()
        out: dict[str, Action] = {}
        for a in rows:
            out.setdefault(a.run_id, a)
        return out

    @staticmethod
    def _open_incidents(session: Any, run_ids: Sequence[str]) -> dict[str, list[Incident]]:
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

    def _spec(self, run: Run) -> RunSpec:
        spec = self._specs.get(run.id)
        if spec is None:
            with self.db.session() as s:
                raw = s.scalar(select(Run.spec_json).where(Run.id == run.id))
            spec = self._specs[run.id] = RunSpec.model_validate(raw)
        return spec

    # ------------------------------------------------------------------ per run

    def _submit_first(
        self, run: Run, attempt: Attempt | None, result: TickResult, now: float
    ) -> None:
        """Submit a pending run; an attempt recorded before a crash is finished, not doubled."""
        if attempt is not None and attempt.job_id:
            job_id: str | None = attempt.job_id
            number = attempt.number
        else:
            failed = attempt is not None and attempt.state is AttemptState.FAILED
            if attempt is not None and failed and not self._retry_first_submit(run, attempt, now):
                return
            number = run.current_attempt + 1 if attempt is None or failed else attempt.number
            job_id = self.actuator.submit_attempt(
                run.id, number, resume_step=run.resume_step, reason="submit"
            )
        if job_id is None:
            return
        with self.db.write_session() as s:
            store.transition_run(
                s,
                run.id,
                RunState.SUBMITTED,
                expected=[RunState.PENDING],
                reason=f"job {job_id}",
                attempt=number,
            )
        result.submitted.append(run.id)

    def _retry_first_submit(self, run: Run, attempt: Attempt, now: float) -> bool:
        """A failed first submission is retried after a backoff while the restart budget
        lasts, then the run needs a person: a submission that always fails must not loop.
        Every attempt of a pending run is a failed submission, so its number counts them."""
        rc = self._spec(run).recovery
        if attempt.number >= rc.max_restarts:
            remedy = Remedy(
                RemedyKind.ESCALATE,
                f"submission failed {attempt.number} times: {attempt.end_reason}",
            )
            self.actuator.apply(ActContext(run.id, attempt.number, None, False), remedy)
            return False
        failed_at = _ts(attempt.ended_at) or now
        return now >= failed_at + backoff_seconds(attempt.number)

    def _note_startup(self, run_id: str, attempt: Attempt, view: MetricsView) -> None:
        """Once per attempt, at its first sample: how long it took from start to first step.

        Kept in memory (a restarted supervisor falls back to the conservative default); an
        attempt first seen long after its start overestimates, which only loosens the limit."""
        started = _ts(attempt.started_at)
        if started is None or self._startup_noted.get(run_id, 0) >= attempt.number:
            return
        stamps = [s.last_step_ts for s in view.samples if s.last_step_ts]
        if not stamps:
            return
        self._startup_noted[run_id] = attempt.number
        took = min(stamps) - started
        if took > 0:
            self._startup_seen[run_id] = max(took, self._startup_seen.get(run_id, 0.0))

    def _checkpoints(self, run: Run, spec: RunSpec) -> list[CheckpointRef]:
        """Complete checkpoints on disk (oldest first); new ones are recorded in the DB."""
        from contracts.checkpoints import list_checkpoints

        folder = self._ckpt_dirs.get(run.id)
        if folder is None:
            folder = self._ckpt_dirs[run.id] = checkpoint_dir(self.config.home, run.id, spec)
        infos = list_checkpoints(folder)
        known = self._known_ckpt.get(run.id, -1)
        for c in infos:
            if c.step > known:
                with self.db.write_session() as s:
                    store.record_checkpoint(
                        s,
                        run.id,
                        step=c.step,
                        consumed_samples=c.consumed_samples,
                        loss=c.loss,
                        path=str(c.path),
                        saved_at=datetime.fromtimestamp(c.saved_at, UTC),
                        complete=c.complete,
                    )
        if infos:
            self._known_ckpt[run.id] = max(known, max(c.step for c in infos))
        return [
            CheckpointRef(step=c.step, saved_at=c.saved_at, consumed_samples=c.consumed_samples)
            for c in sorted(infos, key=lambda c: c.step)
            if c.complete
        ]

    def _reconcile(
        self,
        run: Run,
        attempt: Attempt | None,
        status: JobStatus | None,
        view: MetricsView,
        unfinished: Action | None,
        incidents: list[Incident],
        now: float,
        result: TickResult,
    ) -> None:
        spec = self._spec(run)
        # Unknown to SLURM might still be alive: cancel before resubmitting, to be sure.
        active_job = status is None or status.state is JobState.UNKNOWN or status.state.active
        if run.cancel_requested:
            self.actuator.cancel_run(
                run.id, run.current_attempt, attempt.job_id if attempt else None, active_job
            )
            return
        if unfinished is not None and unfinished.kind == ActionKind.ESCALATE.value:
            # killed mid-escalation: the run may already need attention; finish it anyway
            number = unfinished.attempt or run.current_attempt
            self.actuator.resume(unfinished, ActContext(run.id, number, None, False))
            return
        if run.state is RunState.NEEDS_ATTENTION or attempt is None:
            return
        checkpoints = self._checkpoints(run, spec)
        if run.resume_step is not None:  # rolled back once: later checkpoints may be tainted
            checkpoints = trusted_checkpoints(checkpoints, self._rollbacks(run.id))
        disk_step = checkpoints[-1].step if checkpoints else None
        if unfinished is not None:
            if not result.slurm_up:
                return  # finishing a remedy needs SLURM's answer (cancel before resubmit)
            self._resume(run, attempt, unfinished, status, disk_step, active_job)
            return
        slurm_up = result.slurm_up
        job = job_view(
            status,
            slurm_up=slurm_up,
            attempt=attempt,
            now=now,
            lost_after_s=self.config.lost_after_s,
            log_cause=self._log_cause(run, attempt, status, view),
        )
        self._record_attempt(run, attempt, job)
        self._note_startup(run.id, attempt, view)
        snap = Snapshot(
            run_id=run.id,
            attempt=attempt.number,
            now=now,
            metrics=view,
            job=job,
            checkpoint_interval_steps=spec.checkpoint.interval_steps,
            global_batch_size=spec.training.global_batch_size,
            target_steps=run.target_steps,
            disk_checkpoint_step=disk_step,
            attempt_started_at=_ts(attempt.started_at),
            startup_seconds_seen=self._startup_seen.get(run.id),
        )
        self._check_recovery(run, attempt, view, incidents, now)
        if (
            job.state is AttemptState.COMPLETED
            and disk_step is not None
            and (disk_step >= run.target_steps)
        ):
            self.actuator.complete_run(run.id, attempt.number, disk_step)
            self._close_incidents(incidents, now)
            self.metrics.forget_run(run.id)
            self._startup_seen.pop(run.id, None)
            self._startup_noted.pop(run.id, None)
            self._ettr_exported.pop(run.id, None)
            return
        self._export_run(run, checkpoints, now)
        if (
            view.samples  # nothing to compute yet: no refresh slot taken
            and result.ettr_refreshes < ETTR_REFRESHES_PER_TICK
            and now - self._ettr_exported.get(run.id, -math.inf) >= ETTR_REFRESH_S
        ):
            result.ettr_refreshes += 1
            self._export_ettr(run.id, view, now)
        findings = detect_all(snap, spec.recovery)
        if not findings:
            return
        result.findings[run.id] = findings
        history = self._history(run, job, checkpoints, spec.resources.nodes)
        remedy = decide(snap, findings, history, spec.recovery)
        if remedy.kind is RemedyKind.NONE:
            return
        if run.resume_step is not None and remedy.kind.resubmits and remedy.to_step is None:
            remedy = dataclasses.replace(remedy, to_step=disk_step or 0)
        result.remedies[run.id] = remedy
        step = view.latest.step if view.latest is not None else disk_step
        incident_id = None
        if remedy.kind is not RemedyKind.OBSERVE:
            incident_id = self._incident(run, attempt, remedy, incidents, step, disk_step, now)
        ctx = ActContext(
            run_id=run.id,
            attempt=attempt.number,
            job_id=attempt.job_id,
            job_active=active_job,
            step=step,
            attempt_nodes=job.nodes or tuple(attempt.nodes_json or ()),
            incident_id=incident_id,
            resume_from=disk_step,
        )
        log.info(
            f"{remedy.kind.value}: {remedy.reason}",
            extra={"run_id": run.id, "attempt": attempt.number, "job_id": attempt.job_id},
        )
        if self.actuator.apply(ctx, remedy):
            self.metrics.remedies.labels(kind=remedy.kind.value).inc()
        restarts = restarts_in_window(history, spec.recovery, now, step)
        left = spec.recovery.max_restarts - restarts - int(remedy.kind.resubmits)
        self.metrics.run_budget_left.labels(run_id=run.id).set(max(0, left))
        self._export_ettr(run.id, view, now)

    def _resume(
        self,
        run: Run,
        attempt: Attempt,
        action: Action,
        status: JobStatus | None,
        disk_step: int | None,
        active_job: bool,
    ) -> None:
        if action.kind == ActionKind.SUBMIT.value:
            number = action.attempt or attempt.number
            resume = action.evidence_json.get("resume_step")
            self.actuator.submit_attempt(run.id, number, resume_step=resume, reason="resume")
            return
        number = action.attempt or attempt.number
        job_id = action.evidence_json.get("job_id")
        ctx = ActContext(
            run_id=run.id,
            attempt=number,
            job_id=job_id,
            job_active=active_job and number == attempt.number,
            attempt_nodes=tuple(action.evidence_json.get("attempt_nodes", ())),
            incident_id=action.evidence_json.get("incident_id"),
            resume_from=disk_step,
        )
        self.actuator.resume(action, ctx)

    def _log_cause(
        self, run: Run, attempt: Attempt, status: JobStatus | None, view: MetricsView
    ) -> LogCause:
        if status is None or status.state is not JobState.FAILED:
            return (None, None, ())
        key = (run.id, attempt.number)
        if key not in self._log_causes:
            log_dir = attempt_log_dir(self.config.home, run.id, attempt.number)
            try:
                files = self.cluster.log_files(status.job_id, log_dir=log_dir)
            except OSError:
                files = []
            text = "\n".join(tail(f) for f in files)
            progress = any(s.step for s in view.samples)
            nodes = status.nodes or tuple(attempt.nodes_json or ())
            self._log_causes[key] = log_cause(text, status.exit_code, progress, nodes)
        return self._log_causes[key]

    def _record_attempt(self, run: Run, attempt: Attempt, job: JobView) -> None:
        """Mirror SLURM's view into the attempt row (and SUBMITTED → RUNNING) once."""
        if job.health is not SourceHealth.UP or job.state is None:
            return
        new = job.state
        if new is AttemptState.FAILED and job.exit_code == exitcodes.REQUEUE:
            new = AttemptState.PREEMPTED  # checkpointed on USR2/TERM; SLURM says FAILED 75
        if new is AttemptState.SUBMITTED or attempt.state is new or attempt.ended_at is not None:
            return
        fields: dict[str, Any] = {"state": new}
        if job.nodes:
            fields["nodes_json"] = list(job.nodes)
        now = datetime.now(UTC)
        if new is AttemptState.RUNNING:
            fields["started_at"] = attempt.started_at or now
        else:
            fields.update(ended_at=now, exit_code=job.exit_code, end_reason=job.reason)
        with self.db.write_session() as s:
            store.update_attempt(s, run.id, attempt.number, **fields)
            if new is AttemptState.RUNNING and run.state is RunState.SUBMITTED:
                store.transition_run(
                    s,
                    run.id,
                    RunState.RUNNING,
                    expected=[RunState.SUBMITTED],
                    reason=f"job {job.job_id} running",
                    attempt=attempt.number,
                )
        for k, v in fields.items():
            setattr(attempt, k, v)

    def _incident(
        self,
        run: Run,
        attempt: Attempt,
        remedy: Remedy,
        incidents: list[Incident],
        step: int | None,
        disk_step: int | None,
        now: float,
    ) -> int:
        """The run's open incident (one fault may need several remedies), or a new one."""
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
        fault_ts = finding.fault_time if finding.fault_time is not None else now
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
            return incident.id
        with self.db.write_session() as s:
            incident = store.open_incident(
                s,
                run.id,
                attempt.number,
                finding.kind.value,
                evidence=evidence,
                fault_ts=datetime.fromtimestamp(fault_ts, UTC),
            )
            store.update_incident(s, incident.id, remedy=remedy.kind.value, state=state)
        incidents.append(incident)
        self.metrics.incidents.labels(kind=finding.kind.value).inc()
        latency = accounting.detection_latency(fault_ts, now)
        if latency is not None:
            self.metrics.detection_latency.observe(latency)
        return incident.id

    def _check_recovery(
        self,
        run: Run,
        attempt: Attempt,
        view: MetricsView,
        incidents: list[Incident],
        now: float,
    ) -> None:
        """A remedied incident is recovered once a later attempt trains past its resume step."""
        if view.health is not SourceHealth.UP:
            return
        for incident in [i for i in incidents if i.state is IncidentState.REMEDYING]:
            ev = incident.evidence_json or {}
            if attempt.number <= int(ev.get("remedy_attempt") or incident.attempt or 0):
                continue
            resumed = ev.get("resume_from")
            recovered_t = accounting.recovery_time(view.samples, resumed)
            if recovered_t is None:
                continue
            lost = accounting.steps_lost(ev.get("step"), resumed)
            with self.db.write_session() as s:
                store.update_incident(
                    s,
                    incident.id,
                    state=IncidentState.RECOVERED,
                    recovered_ts=datetime.fromtimestamp(recovered_t, UTC),
                    steps_lost=lost,
                )
            incidents.remove(incident)
            if incident.fault_ts is not None:
                self.metrics.mttr.observe(max(0.0, recovered_t - incident.fault_ts.timestamp()))
            self._export_ettr(run.id, view, now)
            log.info(
                f"recovered from {incident.kind}, {lost} steps lost",
                extra={"run_id": run.id, "attempt": attempt.number},
            )
        if run.state is RunState.RECOVERING and not any(
            i.state is IncidentState.REMEDYING for i in incidents
        ):
            with self.db.write_session() as s:
                store.transition_run(
                    s,
                    run.id,
                    RunState.RUNNING,
                    expected=[RunState.RECOVERING],
                    reason="training progresses again",
                    attempt=attempt.number,
                )

    def _close_incidents(self, incidents: list[Incident], now: float) -> None:
        """The run reached its target with incidents whose recovery was never scraped (a short
        attempt can end between scrapes): dated now, steps lost from the remedy's evidence."""
        for incident in incidents:
            ev = incident.evidence_json or {}
            with self.db.write_session() as s:
                store.update_incident(
                    s,
                    incident.id,
                    state=IncidentState.RECOVERED,
                    recovered_ts=incident.recovered_ts or datetime.fromtimestamp(now, UTC),
                    steps_lost=accounting.steps_lost(ev.get("step"), ev.get("resume_from")),
                )

    def _history(
        self, run: Run, job: JobView, checkpoints: list[CheckpointRef], nodes_needed: int
    ) -> RunHistory:
        with self.db.session() as s:
            actions = s.scalars(
                select(Action).where(Action.run_id == run.id).order_by(Action.id)
            ).all()
            strikes = {n.name: n.strikes for n in s.scalars(select(Node)).all()}
        try:  # spare capacity, asked only when a remedy is being chosen
            usable: list[str] | None = [n.name for n in self.cluster.nodes().values() if n.usable]
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

    def _export_ettr(self, run_id: str, view: MetricsView, now: float) -> None:
        """ETTR gauge, refreshed on remedies, recoveries and every `ETTR_REFRESH_S` (a healthy
        run's dashboard needs it too): steps reached come from the incidents (step before each
        fault), the run's last step and the live gauge."""
        with self.db.session() as s:
            attempts = store.get_attempts(s, run_id)
            evidence = s.scalars(
                select(Incident.evidence_json).where(Incident.run_id == run_id)
            ).all()
            last_step = s.scalar(select(Run.last_step).where(Run.id == run_id))
        starts = [a.started_at.timestamp() for a in attempts if a.started_at is not None]
        first = min(attempts, key=lambda a: a.number, default=None)
        reached = [
            *((ev or {}).get("step") for ev in evidence),
            last_step,
            view.latest.step if view.latest is not None else None,
        ]
        ettr = accounting.run_ettr(
            wall_s=now - min(starts) if starts else 0.0,
            productive_steps=accounting.productive_steps(
                first.resume_step if first is not None else None, reached
            ),
            mean_step_s=median_step_time(view.samples) if view.samples else None,
        )
        self._ettr_exported[run_id] = now  # unknown (no step time yet) waits its turn too
        if ettr is not None:
            self.metrics.run_ettr.labels(run_id=run_id).set(ettr)

    def _export_run(self, run: Run, checkpoints: list[CheckpointRef], now: float) -> None:
        if checkpoints:
            self.metrics.run_checkpoint_age.labels(run_id=run.id).set(
                max(0.0, now - checkpoints[-1].saved_at)
            )


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))


def endpoint_targets(db: Database) -> list[Target]:
    """The registered worker endpoints of active attempts, for the ScrapeSource."""
    with db.session() as s:
        return [
            Target(e.run_id, e.attempt, e.node, e.host, e.port) for e in store.active_endpoints(s)
        ]


def build_reconciler(
    settings: Settings,
    db: Database,
    *,
    registry: CollectorRegistry | None = None,
    supervisor_metrics: SupervisorMetrics | None = None,
    cluster: Cluster | None = None,
) -> Reconciler:
    """The supervisor's reconciler from its Settings: the configured executor (auto: SLURM when
    a controller answers, else submitit's local executor), Prometheus when configured (bridged
    by direct scrapes for attempts it has not scraped yet), else direct scrapes."""
    stale = max(15.0, 3 * settings.tick_seconds)
    scrape = ScrapeSource(lambda: endpoint_targets(db), stale_after_s=stale)
    source: MetricSource = scrape
    if settings.prometheus_url:
        source = PrometheusSource(settings.prometheus_url, stale_after_s=stale, bridge=scrape)
    return Reconciler(
        db,
        cluster or make_cluster(executor=settings.executor),
        source,
        WatchdogConfig(
            home=settings.home,
            supervisor_url=settings.public_url,
            tick_seconds=settings.tick_seconds,
            lease_ttl_s=max(30.0, 5 * settings.tick_seconds),
            node_setup=NodeSetup.from_settings(settings),
        ),
        registry=registry,
        supervisor_metrics=supervisor_metrics,
        notifier=Notifier(settings.webhook_url, db),
    )


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None
