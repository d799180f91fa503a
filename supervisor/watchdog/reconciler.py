"""The reconcile loop: every tick, for every run, observe → detect → decide → act → record.

Level-triggered: each tick recomputes from actual state — the database, ONE batched SLURM
poll for all current jobs, one metrics collection for all runs, checkpoints on disk
(supervisor.watchdog.observe) — so nothing depends on having seen an event, and a restarted
supervisor picks up where the world is. One actor at a time: a tick only acts while this
replica holds the `leases` row (a compare-and-set with expiry on the database's clock),
renewed before each run and checked by every side effect against its epoch
(supervisor.watchdog.lease). An action whose intent survived a crash is resumed before anything
new is decided for that run, and whatever a crash left running that no run may have is
cancelled (supervisor.watchdog.strays).

The parts: `observe` reads, the detectors find, the policy decides (every retry-or-give-up),
the actuator acts (intent first), the ledger records what was seen and decided, telemetry
exports. One run's failure is logged and isolated; each run's reconcile ends in an `Outcome`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from contracts.spec import RunSpec
from supervisor import store
from supervisor.db import Database
from supervisor.launcher import DEFAULT_SIGNAL_LEAD_S, JOB_PREFIX, NodeSetup, signal_lead
from supervisor.metrics import SupervisorMetrics
from supervisor.metrics_in import MetricSource, PrometheusSource, ScrapeSource, Target
from supervisor.models import Action, Attempt, AttemptState, Run, RunState
from supervisor.settings import Settings
from supervisor.slurm import Cluster, JobState, SourceUnavailable, make_cluster
from supervisor.watchdog import policy, strays
from supervisor.watchdog.actions import ActContext, ActionKind, Actuator, ActuatorConfig
from supervisor.watchdog.detectors import (
    contained,
    detect_all,
    hang_probe_at,
    stopping_on_signal,
    unremedied_spikes,
    verdict_due,
    walltime_ends_within,
)
from supervisor.watchdog.lease import Deposed, LeaseGuard
from supervisor.watchdog.ledger import Ledger
from supervisor.watchdog.notify import Notifier
from supervisor.watchdog.observe import Observer, World, job_view, ts
from supervisor.watchdog.progress import changed, observed_progress
from supervisor.watchdog.reserves import Reserve, idle_spares, running_nodes
from supervisor.watchdog.reserves import to_submit as reserves_to_submit
from supervisor.watchdog.snapshot import Finding, Remedy, RemedyKind, Snapshot
from supervisor.watchdog.telemetry import Telemetry

log = logging.getLogger("nightwatch.watchdog")

#: How often the leader lists the cluster's nodes into `nodes`, so that an operator can exclude
#: a node no job of Nightwatch's has run on yet.
NODE_LIST_EVERY_S = 60.0
#: Between ticks, how often the files a fault writes at once (`Observer.evidence_files`) are
#: looked at: one stat each, and a tenth of a second is small next to any restart (≥ 1 s).
WAKE_POLL_S = 0.1
#: What a successor job needs beyond the run's measured start-up before its time limit's stop
#: signal: SLURM scheduling it, with room to spare.
SUCCESSOR_SLACK_S = 30.0

#: A file's (size, mtime); None when it is missing.
Stamp = tuple[int, int] | None


def file_stamp(path: Path) -> Stamp:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


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
    signal_delay_s: int = DEFAULT_SIGNAL_LEAD_S
    holder: str = field(default_factory=default_holder)


class Next(enum.StrEnum):
    """What a run's reconcile leaves for later (controller-runtime's `Result`)."""

    TICK = "tick"  # nothing pending: the next tick looks again, as at every tick
    AFTER = "after"  # something is due later (a backoff, a remedy waiting for SLURM)
    TERMINAL = "terminal"  # the run ended or waits for a person: nothing left to do for it
    ERROR = "error"  # this run's reconcile raised; the others went on


@dataclass(frozen=True)
class Outcome:
    next: Next = Next.TICK
    reason: str = ""
    after_s: float | None = None  # for AFTER, when known


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
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of the tick
    cpu_s: float = 0.0  # CPU time of this process during the tick (robust on a busy machine)
    ettr_refreshes: int = 0
    #: Runs whose observed progress changed this tick (run id → supervisor.watchdog.progress).
    progress: dict[str, dict[str, Any]] = field(default_factory=dict)


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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self.cluster = cluster
        self.source = source
        self.config = config
        self.clock = clock
        self.notifier = notifier or Notifier(None)
        self.registry = registry or CollectorRegistry()
        self.telemetry = Telemetry(db, self.registry, supervisor_metrics)
        self.lease = LeaseGuard(db, config.lease_name, config.holder, config.lease_ttl_s)
        self.observer = Observer(db, cluster, source, config.home)
        self.ledger = Ledger(db)
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
            clock=lambda: self.clock(),
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nodes_listed_at = -NODE_LIST_EVERY_S  # monotonic: list them at the first tick
        #: The evidence files of the runs the last tick reconciled (`Observer.evidence_files`).
        self._evidence: set[Path] = set()
        #: The soonest verdict the last tick saw coming (`verdict_due`, wall clock), if any.
        self._verdict_due: float | None = None
        #: Per (run, attempt), when its hang limit runs out and the step it runs from
        #: (`hang_probe_at`), as the last tick saw it; and the step each was last probed at:
        #: a stall is probed once, at the tick its limit has run out by.
        self._probe_at: dict[tuple[str, int], tuple[float, float]] = {}
        self._probed: dict[tuple[str, int], float] = {}
        #: (run, attempt) whose successor was prepared (or tried): asked once per attempt.
        self._successors: set[tuple[str, int]] = set()
        #: Runs with a live successor job (`strays.live_successors`) as the last listing of
        #: live jobs saw them, and those whose successor was submitted since: no refills.
        self._standby: set[str] = set()
        #: job id → the lead of its stop signal, as its submission recorded it.
        self._leads: dict[str, float] = {}

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
        watched: dict[Path, Stamp] = {}
        while not self._stop.is_set():
            started = time.monotonic()
            seen = {p: file_stamp(p) for p in watched}  # as this tick will find them
            try:
                self.tick()
            except Exception:  # one bad tick must not kill the supervisor
                log.exception("tick failed")
            watched = {p: seen[p] if p in seen else file_stamp(p) for p in self._evidence}
            verdict = None
            if self._verdict_due is not None:
                verdict = time.monotonic() + self._verdict_due - time.time()
            self.wait_for_next_tick(started, time.monotonic() - started, watched, verdict)

    def wait_for_next_tick(
        self,
        started: float,
        took: float,
        watched: dict[Path, Stamp],
        verdict_due: float | None = None,
    ) -> bool:
        """Until the next tick is due, or earlier once a watched file changed from its stamp
        (a bad step recorded, a rank's exit code written), or at `verdict_due` (monotonic)
        when a hang or straggler verdict may become possible then: the fault is acted on in
        a fraction of a second instead of up to a tick later. An early tick starts no sooner
        than the last one's duration after it ended, so the loop is never more than half
        busy. True when woken early (or stopped)."""
        due = started + self.config.tick_seconds
        soonest = started + 2 * took
        if verdict_due is not None:
            due = min(due, max(verdict_due, soonest))
        while True:
            now = time.monotonic()
            if now >= due:
                return due < started + self.config.tick_seconds
            if now >= soonest and any(file_stamp(p) != s for p, s in watched.items()):
                return True
            if self._stop.wait(min(WAKE_POLL_S, due - now)):
                return True

    def tick(self) -> TickResult:
        started = time.perf_counter()
        cpu_started = time.process_time()
        now = self.clock()
        self._evidence = set()
        self._verdict_due = None
        probe = self._due_probes(now)
        result = TickResult(leader=self.lease.acquire())
        if not result.leader:
            return result
        self.notifier.wake()  # the leader sends what is due, an earlier process's too
        self.telemetry.tick_started()
        try:
            self._tick(result, now, probe)
        except Deposed as exc:  # another replica acts now; what this one began, it resumes
            log.warning(f"{exc}: this replica stops acting")
            result.leader = False
        result.duration_s = time.perf_counter() - started
        result.cpu_s = time.process_time() - cpu_started
        result.ettr_refreshes = self.telemetry.ettr_refreshes
        self.telemetry.tick_ended(
            result.duration_s, now, result.slurm_up, self.source.name, result.metrics_up
        )
        return result

    def _due_probes(self, now: float) -> set[tuple[str, int]]:
        """The runs whose hang limit has run out (as the last tick saw them) at a step not
        probed yet: their endpoints are read this tick, each stall once."""
        due = {
            key
            for key, (at, step_ts) in self._probe_at.items()
            if at <= now and self._probed.get(key) != step_ts
        }
        self._probed = {
            key: step_ts
            for key, (_, step_ts) in self._probe_at.items()
            if key in due or self._probed.get(key) == step_ts
        }
        self._probe_at = {}
        return due

    def _tick(self, result: TickResult, now: float, probe: set[tuple[str, int]]) -> None:
        self._node_requests()  # before any submission, which must avoid an excluded node
        self._list_nodes()
        world = self.observer.read_db()
        self.telemetry.keep_runs({r.id for r in world.watched})
        for run in world.pending:
            attempt = world.attempts.get(run.id)
            self._isolated(result, run, "submit failed", self._pending, run, attempt, now, result)
        self.observer.read_sources(world, now, probe)
        result.slurm_up, result.metrics_up = world.slurm_up, world.metrics_up
        result.phases.update(world.phases)
        mark = time.perf_counter()
        for run in world.watched:
            self._isolated(
                result, run, "reconcile failed", self._reconcile, run, world, now, result
            )
        result.runs = len(world.watched)
        self.ledger.record_progress(result.progress)
        result.phases["runs"] = time.perf_counter() - mark
        self._cancel_strays()

    def _isolated(
        self, result: TickResult, run: Run, what: str, step: Callable[..., Outcome], *args: object
    ) -> None:
        """One run's step under the lease; its failure is that run's alone (a lost lease
        stops the whole tick)."""
        try:
            self.lease.keep()
            result.outcomes[run.id] = step(*args)
        except Deposed:
            raise
        except Exception as exc:
            log.exception(what, extra={"run_id": run.id})
            result.errors[run.id] = f"{type(exc).__name__}: {exc}"
            result.outcomes[run.id] = Outcome(Next.ERROR, result.errors[run.id])

    # ------------------------------------------------------------------ per run

    def _pending(
        self, run: Run, attempt: Attempt | None, now: float, result: TickResult
    ) -> Outcome:
        """Submit a pending run; an attempt recorded before a crash is finished, not doubled."""
        if run.cancel_requested:  # after a failed or cut-off submission
            job_id = attempt.job_id if attempt else None
            self.actuator.cancel_run(run.id, run.current_attempt, job_id, True)
            return Outcome(Next.TERMINAL, "cancelled")
        if attempt is not None and attempt.job_id:
            job_id: str | None = attempt.job_id
            number = attempt.number
        else:
            failed = attempt is not None and attempt.state is AttemptState.FAILED
            if attempt is not None and failed:
                rc = self.observer.spec(run).recovery
                failed_at = ts(attempt.ended_at)
                retry = policy.first_submit(attempt.number, attempt.end_reason, failed_at, now, rc)
                if retry.kind is RemedyKind.ESCALATE:
                    self.actuator.apply(ActContext(run.id, attempt.number, None, False), retry)
                    return Outcome(Next.TERMINAL, retry.reason)
                if retry.kind is RemedyKind.NONE:
                    due = policy.first_submit_due(attempt.number, failed_at, now)
                    return Outcome(Next.AFTER, retry.reason, due - now)
            number = run.current_attempt + 1 if attempt is None or failed else attempt.number
            job_id = self.actuator.submit_attempt(
                run.id, number, resume_step=run.resume_step, reason="submit"
            )
        if job_id is None:
            return Outcome(Next.AFTER, "submission failed")
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
        return Outcome()

    def _reconcile(self, run: Run, world: World, now: float, result: TickResult) -> Outcome:
        attempt = world.attempts.get(run.id)
        status = world.status(attempt)
        view = world.view(run)
        unfinished = world.unfinished.get(run.id)
        incidents = world.incidents.get(run.id, [])
        spec = self.observer.spec(run)
        # Unknown to SLURM might still be alive: cancel before resubmitting, to be sure.
        active_job = status is None or status.state is JobState.UNKNOWN or status.state.active
        job_running = status is not None and status.state is JobState.RUNNING
        if attempt is not None:
            status = self.observer.ranks_ended(run, attempt, status, spec, now)
            self._evidence.update(self.observer.evidence_files(run, attempt, spec))
        if run.cancel_requested:
            self.actuator.cancel_run(
                run.id, run.current_attempt, attempt.job_id if attempt else None, active_job
            )
            return Outcome(Next.TERMINAL, "cancelled")
        if unfinished is not None and unfinished.kind == ActionKind.ESCALATE.value:
            # killed mid-escalation, or its cancel failed: the run may already need attention;
            # finish it anyway, job included (on_escalation: cancel frees it)
            number = unfinished.attempt or run.current_attempt
            job_id = attempt.job_id if attempt is not None and attempt.number == number else None
            ctx = ActContext(run.id, number, job_id, active_job and job_id is not None)
            self.actuator.resume(unfinished, ctx)
            return Outcome(Next.TERMINAL, "escalated")
        if run.operator_request_json is not None and unfinished is None and attempt is not None:
            return self._operator_request(
                run, attempt, run.operator_request_json, active_job, job_running
            )
        if run.state is RunState.NEEDS_ATTENTION or attempt is None:
            return Outcome(Next.TERMINAL if attempt else Next.TICK, run.state.value)
        # observe
        disk = self.observer.disk(run, spec, world.recorded_step.get(run.id))
        if unfinished is not None:
            self.ledger.record_checkpoints(run, disk.unrecorded)
            if not world.slurm_up:  # finishing a remedy needs SLURM's answer (cancel first)
                return Outcome(Next.AFTER, "SLURM down: resuming the unfinished action later")
            self._resume(run, attempt, unfinished, disk.step, active_job)
            return Outcome()
        job = job_view(
            status,
            slurm_up=world.slurm_up,
            attempt=attempt,
            now=now,
            lost_after_s=self.config.lost_after_s,
            log_cause=self.observer.log_cause(run, attempt, status, view),
        )
        reserves = world.reserves.get(run.id, [])
        job_nodes = (*job.nodes, *running_nodes(reserves, world.statuses))
        if spec.resources.spare_nodes and job.nodes:
            active = self.observer.active_nodes(run, attempt, spec, job.nodes)
            job = dataclasses.replace(job, nodes=active)
        # record what was seen (the attempt's state before anything is decided from it)
        recovered = self.ledger.record_observation(
            run, attempt, job, view, unrecorded=disk.unrecorded, incidents=incidents, now=now
        )
        startup = [t for t in (world.startup_seen.get(run.id), attempt.first_step_s) if t]
        for r in recovered:
            self.telemetry.recovered(run.id, ts(r.incident.fault_ts), r.recovered_t, view, now)
            log.info(
                f"recovered from {r.incident.kind}, {r.steps_lost} steps lost",
                extra={"run_id": run.id, "attempt": attempt.number},
            )
        snap = Snapshot(
            run_id=run.id,
            attempt=attempt.number,
            now=now,
            metrics=view,
            job=job,
            checkpoint_interval_steps=spec.checkpoint.interval_steps,
            global_batch_size=spec.training.global_batch_size,
            warmup_steps=spec.training.lr_warmup_steps,
            target_steps=run.target_steps,
            disk_checkpoint_step=disk.step,
            attempt_started_at=ts(attempt.started_at),
            startup_seconds_seen=max((t for t in startup if t > 0), default=None),
            anomalies=tuple(
                a for a in self.observer.anomalies(run, spec) if a.attempt == attempt.number
            ),
        )
        self.ledger.record_contained(run, attempt.number, contained(snap, spec.recovery))
        if spec.checkpoint.interval_auto:
            self.ledger.record_interval(run, attempt.number, self.observer.save_timing(run, spec))
        if (
            job.state is AttemptState.COMPLETED
            and disk.step is not None
            and disk.step >= run.target_steps
            # A spike the last attempt trained through to the end is not a finished run: its
            # final model holds the spike, so the detectors below roll it back like any other.
            and not unremedied_spikes(snap, spec.recovery)
        ):
            self.ledger.forget(run.id)
            self.actuator.complete_run(run.id, attempt.number, disk.step)
            self.ledger.close_incidents(incidents, now)
            self.telemetry.run_finished(run.id)
            return Outcome(Next.TERMINAL, f"reached step {disk.step}")
        self.telemetry.run_seen(run.id, disk.checkpoints, view, now)
        seen = observed_progress(
            view, run.target_steps, disk.step, self.telemetry.last_ettr.get(run.id), now
        )
        if seen is not None and changed(run.progress_json, seen):
            result.progress[run.id] = seen
        # detect
        findings = detect_all(snap, spec.recovery)
        due = verdict_due(snap, spec.recovery)
        probe_at = hang_probe_at(snap, spec.recovery)
        if probe_at is not None:
            key = (snap.run_id, snap.attempt)
            self._probe_at[key] = probe_at
            if self._probed.get(key) != probe_at[1]:
                due = min(probe_at[0], due if due is not None else probe_at[0])
        if due is not None and due > now:
            self._verdict_due = min(due, self._verdict_due or due)
        self._prepare_successor(run, attempt, spec, snap)
        if not findings:
            # while a successor stands by the job stops soon: its reserves are strays then
            refill = spec.resources.spare_nodes and run.id not in self._standby
            if refill and job_running and job.state is AttemptState.RUNNING:
                self._refill_spares(run, attempt, spec, job_nodes, job.nodes, reserves, world, now)
            return Outcome()
        result.findings[run.id] = findings
        # decide
        history = self.observer.history(run, job, disk.checkpoints, spec.resources.nodes)
        remedy = policy.decide(snap, findings, history, spec.recovery)
        if remedy.kind is RemedyKind.NONE:
            return Outcome(Next.AFTER, remedy.reason)
        remedy = policy.resume_point(remedy, run.resume_step, disk.step)
        result.remedies[run.id] = remedy
        step = view.latest.step if view.latest is not None else disk.step
        incident_id = None
        if remedy.kind is not RemedyKind.OBSERVE:
            incident_id, opened = self.ledger.record_incident(
                run, attempt, remedy, incidents, step, disk.step, now
            )
            if opened:
                assert remedy.finding is not None
                self.telemetry.incident_opened(remedy.finding, now)
        # act
        ctx = ActContext(
            run_id=run.id,
            attempt=attempt.number,
            job_id=attempt.job_id,
            job_active=active_job,
            step=step,
            job_running=job_running,
            job_nodes=job_nodes,
            attempt_nodes=job.nodes or tuple(attempt.nodes_json or ()),
            incident_id=incident_id,
            resume_from=disk.step,
        )
        log.info(
            f"{remedy.kind.value}: {remedy.reason}",
            extra={"run_id": run.id, "attempt": attempt.number, "job_id": attempt.job_id},
        )
        applied = self.actuator.apply(ctx, remedy)
        left = policy.budget_left(history, spec.recovery, now, step, remedy)
        self.telemetry.remedied(run.id, remedy, applied, left, view, now)
        if remedy.kind is RemedyKind.ESCALATE:
            return Outcome(Next.TERMINAL, remedy.reason)
        return Outcome(Next.TICK if applied else Next.AFTER, remedy.reason)

    def _prepare_successor(self, run: Run, attempt: Attempt, spec: RunSpec, snap: Snapshot) -> None:
        """Submit the next attempt's standby job (`Actuator.prepare_successor`; once per
        attempt) when the ranks stop on a signal, or when the job's time limit is nearer
        than its stop signal's lead (the one it was submitted with) plus what a successor
        needs to be ready: the run's measured start-up (imports, set-up, first step) and
        `SUCCESSOR_SLACK_S` for SLURM."""
        rc = spec.recovery
        key = (run.id, attempt.number)
        if not (rc.restart_in_job and rc.prepare_successor) or key in self._successors:
            return
        reason = stopping_on_signal(snap)
        if reason is None and snap.job.time_left_s is not None and attempt.job_id:
            lead = self._signal_lead(run, attempt.job_id, spec)
            ready = snap.startup_seconds_seen or 0.0
            reason = walltime_ends_within(snap, lead + ready + SUCCESSOR_SLACK_S)
        if reason is not None:
            if self.actuator.prepare_successor(run.id, attempt.number + 1, reason=reason):
                self._standby.add(run.id)
            self._successors.add(key)

    def _refill_spares(
        self,
        run: Run,
        attempt: Attempt,
        spec: RunSpec,
        job_nodes: tuple[str, ...],
        attempt_nodes: tuple[str, ...],
        reserves: list[Reserve],
        world: World,
        now: float,
    ) -> None:
        """Submit a reserve job when the running job's idle spares (its own and its running
        reserves') fell below `resources.spare_nodes` (`supervisor.watchdog.reserves`)."""
        spares = spec.resources.spare_nodes
        excluded = {*run.excluded_nodes_json, *world.fleet_excluded}
        reserve = reserves_to_submit(
            spares, job_nodes, attempt_nodes, excluded, reserves, world.statuses, now
        )
        if reserve is None:
            return
        ctx = ActContext(
            run.id, attempt.number, attempt.job_id, True, job_running=True,
            job_nodes=job_nodes, attempt_nodes=attempt_nodes,
        )  # fmt: skip
        idle = idle_spares(job_nodes, attempt_nodes, excluded)
        reason = f"{len(idle)} idle spare(s) in the job for {spares}: {', '.join(idle) or '-'}"
        self.actuator.submit_reserve(ctx, reserve, reason)

    def _signal_lead(self, run: Run, job_id: str, spec: RunSpec) -> float:
        """The lead of the job's stop signal: as its submission recorded it (kept per job),
        else as a submission now would compute it."""
        lead = self._leads.get(job_id)
        if lead is None:
            lead = self.observer.submitted_signal_lead(run.id, job_id)
            if lead is None:
                timing = self.observer.save_timing(run, spec)
                minutes = spec.resources.time_limit_minutes
                return float(signal_lead(timing, minutes, self.config.signal_delay_s)[0])
            self._leads[job_id] = lead
        return lead

    def _operator_request(
        self,
        run: Run,
        attempt: Attempt,
        request: dict[str, Any],
        active_job: bool,
        job_running: bool,
    ) -> Outcome:
        """Carry out an operator's resume / rollback through the actuator, once: the action
        is keyed by the request's id, so after a crash between the action and the clearing of
        the request, the request is only cleared."""
        rid = request["id"]
        with self.db.session() as s:
            recorded = store.operator_action_recorded(s, run.id, rid)
        if not recorded:
            to_step = request.get("to_step")
            remedy = Remedy(
                kind=RemedyKind.ROLLBACK if to_step is not None else RemedyKind.RESTART,
                reason=f"operator {request['kind']} by {request['by']}",
                to_step=to_step,
                skip_ranges=tuple((a, b) for a, b in request.get("skip_ranges", ())),
                operator_request=rid,
            )
            ctx = ActContext(
                run_id=run.id,
                attempt=attempt.number,
                job_id=attempt.job_id,
                job_active=active_job,
                job_running=job_running,
                step=run.last_step,
                attempt_nodes=tuple(attempt.nodes_json or ()),
                incident_id=None,
                resume_from=to_step,
            )
            log.info(remedy.reason, extra={"run_id": run.id, "attempt": attempt.number})
            if not self.actuator.apply(ctx, remedy):
                return Outcome(Next.AFTER, "operator request: retrying")
        with self.db.write_session() as s:
            store.clear_operator_request(s, run.id, rid)
        return Outcome()

    def _resume(
        self, run: Run, attempt: Attempt, action: Action, disk_step: int | None, active_job: bool
    ) -> None:
        number = action.attempt or attempt.number
        if action.kind == ActionKind.SUBMIT.value:
            resume = action.evidence_json.get("resume_step")
            self.actuator.submit_attempt(run.id, number, resume_step=resume, reason="resume")
            return
        ctx = ActContext(
            run_id=run.id,
            attempt=number,
            job_id=action.evidence_json.get("job_id"),
            job_active=active_job and number == attempt.number,
            attempt_nodes=tuple(action.evidence_json.get("attempt_nodes", ())),
            incident_id=action.evidence_json.get("incident_id"),
            resume_from=disk_step,
        )
        self.actuator.resume(action, ctx)

    def _node_requests(self) -> None:
        """Carry out operators' pending exclude / restore of nodes, oldest first; one that
        waits for SLURM is tried again next tick."""
        with self.db.session() as s:
            pending = store.pending_node_actions(s)
        for action in pending:
            self.lease.keep()
            try:
                self.actuator.node_action(action)
            except Deposed:
                raise
            except Exception:  # one bad request must not stop the runs' reconcile
                log.exception(f"node {action.kind.value} of {action.node} failed")

    def _list_nodes(self) -> None:
        """Record the nodes the cluster has that the database does not know yet (at most
        every NODE_LIST_EVERY_S; skipped while SLURM does not answer)."""
        if time.monotonic() - self._nodes_listed_at < NODE_LIST_EVERY_S:
            return
        try:
            names = set(self.cluster.nodes())
        except SourceUnavailable as exc:
            log.warning(f"listing nodes failed: {exc}")
            return
        self._nodes_listed_at = time.monotonic()
        with self.db.session() as s:
            new = names - store.node_names(s)
        if new:
            with self.db.write_session() as s:
                store.add_nodes(s, new)

    def _cancel_strays(self) -> None:
        """Cancel the live jobs no run may have (one listing a tick; skipped while SLURM
        does not answer)."""
        try:
            live = self.cluster.live_jobs(JOB_PREFIX)
        except SourceUnavailable as exc:
            log.warning(f"listing live jobs failed: {exc}")
            return
        with self.db.session() as s:
            runs = strays.load_runs(s, (job.name for job in live.values()))
        self._standby = set(strays.live_successors(live, runs))
        for stray in strays.find_strays(live, runs):
            self.actuator.cancel_stray(stray.run_id, stray.attempt, stray.job_id, stray.reason)
        with self.db.session() as s:
            leftovers = strays.unfinished_on_ended_runs(s)
        for key, kind, target in leftovers:
            if kind != ActionKind.CANCEL.value or target not in live:
                self.actuator.close_leftover(key, kind, target)


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
