"""The only code that changes the world: submit, cancel, exclude, roll back, escalate, and an
operator's exclude / restore of a node.

Every action is keyed (run, attempt, kind, target) in the actions table. The intent row, with
its evidence, is written before anything happens and the outcome after, so:
- a replay of a finished action is a no-op (the unique key refuses a second intent);
- a replica that lost the lease cannot act: the intent is recorded under the lease's fence,
  and every call that changes SLURM holds the lease while it runs (supervisor.watchdog.lease);
- notifications are outbox rows committed with the outcome (or, for an escalation, with the
  state change), so they are sent at least once (supervisor.watchdog.notify);
- an unfinished one (the supervisor died mid-way) is resumed by running its steps again, and
  each step is itself idempotent: cancel only an active job, set-union skips and exclusions,
  and never submit attempt N twice (the submit sub-action has its own key, and a submission
  that may have happened is looked up by its job name / submitit folder before resubmitting).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from contracts import anomalies, checkpoints
from contracts.paths import attempt_log_dir, checkpoint_dir, reserve_log_dir, run_dir
from contracts.restart import RestartOrder, job_control_dir, request_leave, write_order
from contracts.spec import RunSpec
from supervisor import accounting, store
from supervisor.auth import Scope
from supervisor.db import Database
from supervisor.launcher import (
    DEFAULT_SIGNAL_LEAD_S,
    NodeSetup,
    ReserveFor,
    SubmitPlan,
    job_name,
    reserve_job_name,
    signal_lead,
    submit,
)
from supervisor.models import (
    Action,
    ActionState,
    Attempt,
    AttemptState,
    Incident,
    NodeAction,
    NodeActionKind,
    NodeHealth,
    Run,
    RunState,
)
from supervisor.slurm import Cluster, SourceUnavailable, Unsupported
from supervisor.watchdog.lease import LeaseGuard
from supervisor.watchdog.notify import Notifier
from supervisor.watchdog.reserves import Reserve, idle_spares
from supervisor.watchdog.snapshot import Remedy, RemedyKind

log = logging.getLogger("nightwatch.watchdog.actions")


class ActionKind(enum.StrEnum):
    """Action rows' `kind`: the remedies plus the reconciler's own chores."""

    SUBMIT = "submit"
    #: A remedy's next attempt started inside the running job (`contracts.restart`): the
    #: in-job counterpart of SUBMIT, keyed by the job.
    RESTART_IN_JOB = "restart_in_job"
    #: The next attempt's job submitted while the current attempt stops on a walltime or
    #: preemption warning (a standby job: its nodes import and wait for the requeue's order),
    #: keyed by the next attempt.
    PREPARE_SUCCESSOR = "prepare_successor"
    #: A reserve job whose nodes join the running job as its spares once a node fault used
    #: one up (`supervisor.watchdog.reserves`), keyed by the job and the reserve's number.
    RESERVE = "reserve"
    CANCEL = "cancel"
    COMPLETE = "complete"
    RESTART = RemedyKind.RESTART.value
    ROLLBACK = RemedyKind.ROLLBACK.value
    EXCLUDE_NODE = RemedyKind.EXCLUDE_NODE.value
    REQUEUE = RemedyKind.REQUEUE.value
    ESCALATE = RemedyKind.ESCALATE.value
    OBSERVE = RemedyKind.OBSERVE.value


#: How a drain by Nightwatch (recovery.drain_excluded_nodes) is told apart in SLURM's reason:
#: an operator's restore resumes only those.
DRAIN_REASON_PREFIX = "nightwatch:"

#: Remedies whose `to_step` rolls training back (later checkpoints may hold thrown-away state).
ROLLS_BACK = frozenset({RemedyKind.ROLLBACK, RemedyKind.EXCLUDE_NODE})
#: Remedies that indict no node: their next attempt may start inside the running job.
RESTARTS_IN_JOB = frozenset({RemedyKind.RESTART, RemedyKind.ROLLBACK})


@dataclass(frozen=True)
class InJob:
    """Where a remedy's next attempt starts inside the running job: the job, and the nodes
    that run its ranks (empty: the same as before; else a spare in place of a bad node)."""

    job_id: str
    nodes: tuple[str, ...] = ()


def swap_in_spares(
    active: Sequence[str], job_nodes: Sequence[str], bad: Sequence[str], excluded: Sequence[str]
) -> tuple[str, ...] | None:
    """`active` with each bad node replaced, in its place (rank order kept), by a node of the
    job that runs no ranks and is neither bad nor excluded; None when the spares run short."""
    out = set(bad) | set(excluded)
    spares = idle_spares(job_nodes, active, out)
    nodes = []
    for node in active:
        if node in bad:
            if not spares:
                return None
            node = spares.pop(0)
        nodes.append(node)
    return tuple(nodes)


def merge_ranges(ranges: Sequence[Sequence[int]]) -> list[list[int]]:
    """Union of half-open ranges, sorted, as JSON lists; re-applying a skip changes nothing."""
    return [list(r) for r in anomalies.merge_ranges((a, b) for a, b in ranges)]


@dataclass(frozen=True)
class ActuatorConfig:
    home: Path
    supervisor_url: str | None = None
    node_setup: NodeSetup = field(default_factory=NodeSetup)
    signal_delay_s: int = DEFAULT_SIGNAL_LEAD_S


@dataclass(frozen=True)
class ActContext:
    """What the actuator needs to know about the run's current attempt."""

    run_id: str
    attempt: int
    job_id: str | None
    job_active: bool
    step: int | None = None
    #: The job holds its nodes now (SLURM says RUNNING): a restart may happen inside it.
    job_running: bool = False
    #: Every node the job holds, spares (`resources.spare_nodes`) included; `attempt_nodes`
    #: are those that run the attempt's ranks.
    job_nodes: tuple[str, ...] = ()
    attempt_nodes: tuple[str, ...] = ()
    incident_id: int | None = None
    resume_from: int | None = None  # newest complete checkpoint on disk now
    extra: dict[str, Any] = field(default_factory=dict)


def remedy_evidence(remedy: Remedy, ctx: ActContext) -> dict[str, Any]:
    """What the intent row records; the policy's run history is rebuilt from exactly this."""
    f = remedy.finding
    return {
        "reason": remedy.reason,
        "suspect": remedy.suspect.value,
        "finding_kind": f.kind.value if f else None,
        "finding": f.summary if f else None,
        "finding_evidence": dict(f.evidence) if f else {},
        "fault_time": f.fault_time if f else None,
        "last_healthy_step": f.last_healthy_step if f else None,
        "first_bad_step": f.first_bad_step if f else None,
        "step": ctx.step,
        "to_step": remedy.to_step,
        "skip_ranges": [list(r) for r in remedy.skip_ranges],
        "exclude_nodes": list(remedy.exclude_nodes),
        "finding_nodes": list(f.nodes) if f else [],
        "attempt_nodes": list(ctx.attempt_nodes),
        "job_id": ctx.job_id,
        "incident_id": ctx.incident_id,
        **ctx.extra,
    }


class Actuator:
    def __init__(
        self,
        db: Database,
        cluster: Cluster,
        config: ActuatorConfig,
        notifier: Notifier,
        lease: LeaseGuard | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self.cluster = cluster
        self.config = config
        self.notifier = notifier
        self.lease = lease  # None: a lone actuator (scripts, unit tests) fences nothing
        self.clock = clock  # the reconciler's: attempts end at the tick's time

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)

    @contextlib.contextmanager
    def _side_effect(self) -> Iterator[None]:
        """Fence one call that changes the world and hold the lease while it runs."""
        if self.lease is None:
            yield
            return
        with self.lease.held():
            yield

    # ------------------------------------------------------------------ bookkeeping

    def _action(self, key: str) -> Action | None:
        with self.db.session() as s:
            return s.scalar(select(Action).where(Action.key == key))

    def _begin(
        self, run_id: str, attempt: int, kind: ActionKind, target: str, evidence: dict[str, Any]
    ) -> str | None:
        """The action's key when it must (still) be carried out; None when already done."""
        key = store.action_key(run_id, attempt, kind.value, target)
        fence = self.lease.fence if self.lease is not None else None
        with self.db.write_session() as s:
            intent = store.begin_action(
                s, run_id, attempt, kind.value, target, evidence, fence=fence
            )
            if intent is not None:
                return key
        existing = self._action(key)
        if existing is not None and existing.state is ActionState.INTENT:
            log.info(f"resuming unfinished {kind.value} {target}", extra=_ctx(run_id, attempt))
            return key
        return None

    def _finish(
        self, key: str, ok: bool, result: dict[str, Any], notice: str | None = None, **fields: Any
    ) -> None:
        """Record the outcome, with its notification (if any) in the same transaction."""
        with self.db.write_session() as s:
            if notice is not None:
                self.notifier.enqueue(s, key, notice, **fields)
            store.finish_action(s, key, ok=ok, result=result)
        if notice is not None:
            self.notifier.wake()

    # ------------------------------------------------------------------ submit

    def submit_attempt(
        self, run_id: str, number: int, *, resume_step: int | None, reason: str
    ) -> str | None:
        """Submit attempt `number` exactly once; returns its job id (None: failed or unknown)."""
        key = self._begin(
            run_id, number, ActionKind.SUBMIT, "-", {"reason": reason, "resume_step": resume_step}
        )
        if key is None:
            with self.db.session() as s:
                attempt = _attempt(s, run_id, number)
                return attempt.job_id if attempt else None
        with self.db.session() as s:
            run = store.get_run(s, run_id)
            attempt = _attempt(s, run_id, number)
            # the run's own exclusions and the nodes an operator took out of the fleet
            exclude = sorted({*run.excluded_nodes_json, *store.fleet_excluded_nodes(s)})
        spec = RunSpec.model_validate(run.spec_json)
        log_dir = attempt_log_dir(self.config.home, run_id, number)
        if attempt is not None and attempt.job_id:
            self._finish(key, True, {"job_id": attempt.job_id, "recovered": True})
            return attempt.job_id
        # A standby job prepared for the attempt is not its submission: had the requeue
        # taken it, the attempt would have recorded it.
        prepared = self._prepared(run_id, number)
        standby = (prepared.result_json or {}).get("job_id") if prepared else None
        with self._side_effect():
            found = self._already_submitted(
                run_id, number, log_dir, frozenset({standby}) if standby else frozenset()
            )
        if attempt is None:
            if run.current_attempt != number - 1:
                self._finish(key, False, {"error": f"attempt {run.current_attempt} is current"})
                return None
            with self.db.write_session() as s:
                attempt = store.create_attempt(
                    s,
                    run_id,
                    executor=self.cluster.kind,
                    resume_step=resume_step,
                    skip_ranges=merge_ranges(run.skip_ranges_json),
                    exclude=exclude,
                )
        stop_signal: dict[str, Any] = {}
        if found:
            job_id = found
        else:
            plan, stop_signal = self._plan(run, spec, number, resume_step, exclude)
            try:
                with self._side_effect():
                    job_id = submit(self.cluster, plan).job_id
            except (SourceUnavailable, Unsupported, OSError) as exc:
                with self.db.write_session() as s:
                    store.update_attempt(
                        s,
                        run_id,
                        number,
                        state=AttemptState.FAILED,
                        end_reason=f"submit failed: {exc}",
                        ended_at=self._now(),
                    )
                self._finish(key, False, {"error": str(exc)})
                log.warning(f"submit failed: {exc}", extra=_ctx(run_id, number))
                return None
        with self.db.write_session() as s:
            store.update_attempt(s, run_id, number, job_id=job_id)
        self._finish(key, True, {"job_id": job_id, **stop_signal})
        log.info("submitted", extra={**_ctx(run_id, number), "job_id": job_id})
        return job_id

    def _plan(
        self,
        run: Run,
        spec: RunSpec,
        number: int,
        resume_step: int | None,
        exclude: Sequence[str],
        *,
        standby: bool = False,
    ) -> tuple[SubmitPlan, dict[str, Any]]:
        """Attempt `number`'s submission (with its worker token), and what its stop signal
        and MTBF were computed from. A standby job's nodes wait for their order as long as
        the stop signal's lead plus `recovery.restart_wait_seconds`: by then the attempt
        before it has ended, and the requeue's order is out or will never come."""
        with self.db.write_session() as s:
            _token, secret = store.create_token(
                s, f"worker-{run.id}-a{number}", [Scope.SUBMIT], run_id=run.id
            )
        ckpt_dir = checkpoint_dir(self.config.home, run.id, spec)
        mtbf = self._mtbf(run.id, spec) if spec.checkpoint.interval_auto else None
        lead, lead_basis = signal_lead(
            checkpoints.read_save_timing(ckpt_dir),
            spec.resources.time_limit_minutes,
            self.config.signal_delay_s,
        )
        plan = SubmitPlan(
            run_id=run.id,
            attempt=number,
            spec=spec,
            checkpoint_dir=ckpt_dir,
            log_dir=attempt_log_dir(self.config.home, run.id, number),
            resume_step=resume_step,
            skip_ranges=tuple((int(a), int(b)) for a, b in merge_ranges(run.skip_ranges_json)),
            exclude=tuple(exclude),
            supervisor_url=self.config.supervisor_url,
            worker_token=secret,
            node_setup=self.config.node_setup,
            signal_delay_s=lead,
            mtbf_seconds=mtbf[0] if mtbf else None,
            run_dir=run_dir(self.config.home, run.id),
            standby_wait_s=lead + spec.recovery.restart_wait_seconds if standby else 0.0,
        )
        stop_signal: dict[str, Any] = {"signal_lead_s": lead, "signal_lead": lead_basis}
        if mtbf:
            stop_signal.update(mtbf_s=round(mtbf[0]), mtbf=mtbf[1])
        return plan, stop_signal

    def prepare_successor(self, run_id: str, number: int, *, reason: str) -> str | None:
        """Submit attempt `number`'s job as a standby job, exactly once, while the attempt
        before it stops on a warning: SLURM schedules it and its nodes import the training
        program during the save, and the requeue then starts it by an order (`_in_job`).
        No attempt row yet: the run stays on its current attempt until the requeue. Returns
        the job id (None: already prepared, or the submission failed)."""
        key = self._begin(run_id, number, ActionKind.PREPARE_SUCCESSOR, "-", {"reason": reason})
        if key is None:
            return None
        with self.db.session() as s:
            run = store.get_run(s, run_id)
            exclude = sorted({*run.excluded_nodes_json, *store.fleet_excluded_nodes(s)})
        spec = RunSpec.model_validate(run.spec_json)
        log_dir = attempt_log_dir(self.config.home, run_id, number)
        with self._side_effect():
            job_id = self._find_submitted(run_id, number, log_dir)
        evidence: dict[str, Any] = {}
        if job_id is None:
            plan, evidence = self._plan(run, spec, number, None, exclude, standby=True)
            try:
                with self._side_effect():
                    job_id = submit(self.cluster, plan).job_id
            except (SourceUnavailable, Unsupported, OSError) as exc:
                self._finish(key, False, {"error": str(exc)})
                log.warning(f"successor not submitted: {exc}", extra=_ctx(run_id, number))
                return None
        self._finish(key, True, {"job_id": job_id, **evidence})
        log.info("successor submitted", extra={**_ctx(run_id, number), "job_id": job_id})
        return job_id

    def submit_reserve(self, ctx: ActContext, reserve: Reserve, reason: str) -> str | None:
        """Submit `reserve` (its seq, node count, and the attempt an unfinished intent was
        keyed by) for the running job `ctx.job_id`, exactly once (intent first; a submission
        whose outcome was never recorded is found by its name), on none of the job's nodes:
        its node tasks become spares of the job's current attempt
        (`supervisor.watchdog.reserves`). Returns its job id (None: already submitted, or the
        submission failed or must be retried)."""
        assert ctx.job_id is not None
        seq, count = reserve.seq, reserve.count
        keyed = reserve.attempt if reserve.attempt is not None else ctx.attempt
        evidence = {
            "job_id": ctx.job_id,
            "nodes": count,
            "reason": reason,
            "attempt_nodes": list(ctx.attempt_nodes),
            "job_nodes": list(ctx.job_nodes),
        }
        target = f"{ctx.job_id}-r{seq}"
        key = self._begin(ctx.run_id, keyed, ActionKind.RESERVE, target, evidence)
        if key is None:
            return None
        with self.db.session() as s:
            run = store.get_run(s, ctx.run_id)
            fleet = store.fleet_excluded_nodes(s)
        exclude = sorted({*run.excluded_nodes_json, *fleet, *ctx.job_nodes})
        # a folder of its own: an orphan pickle there is this submission's (finish_submission)
        log_dir = reserve_log_dir(self.config.home, ctx.run_id) / target
        name = reserve_job_name(ctx.run_id, ctx.job_id, seq)
        try:
            with self._side_effect():
                found = self.cluster.find_jobs(name)
                if found and self.cluster.finish_submission(found[-1], log_dir):
                    log.warning(f"reserve {found[-1]} was submitted without its task",
                                extra=_ctx(ctx.run_id, ctx.attempt))  # fmt: skip
            if found:
                job_id = found[-1]
            else:
                spec = RunSpec.model_validate(run.spec_json)
                plan, _ = self._plan(run, spec, ctx.attempt, None, exclude)
                folder = attempt_log_dir(self.config.home, ctx.run_id, ctx.attempt) / ctx.job_id
                plan = replace(
                    plan,
                    log_dir=log_dir,
                    reserve=ReserveFor(ctx.job_id, seq, count, ctx.attempt_nodes, folder),
                )
                with self._side_effect():
                    job_id = submit(self.cluster, plan).job_id
        except SourceUnavailable as exc:  # the intent stays: the next tick tries again
            log.warning(f"reserve not submitted yet: {exc}", extra=_ctx(ctx.run_id, ctx.attempt))
            return None
        except (Unsupported, OSError) as exc:
            self._finish(key, False, {"error": str(exc)})
            log.warning(f"reserve not submitted: {exc}", extra=_ctx(ctx.run_id, ctx.attempt))
            return None
        self._finish(key, True, {"job_id": job_id, "nodes": count})
        log.info(f"reserve of {count} node(s) submitted for job {ctx.job_id}",
                 extra={**_ctx(ctx.run_id, ctx.attempt), "job_id": job_id})  # fmt: skip
        return job_id

    def _successor(self, run_id: str, number: int) -> str | None:
        """The standby job prepared for attempt `number` while SLURM still holds it (pending
        or running), else None: the requeue submits anew, and the standby job (if any) is a
        stray the next tick cancels."""
        prepared = self._prepared(run_id, number)
        if prepared is None:
            return None
        job_id = (prepared.result_json or {}).get("job_id")
        if job_id is None and prepared.state is ActionState.INTENT:
            # its submission's outcome was never recorded (a crash): found by name, or none
            with self._side_effect():
                job_id = self._find_submitted(
                    run_id, number, attempt_log_dir(self.config.home, run_id, number)
                )
            self._finish(prepared.key, job_id is not None, {"job_id": job_id})
        if job_id is None:
            return None
        try:
            status = self.cluster.poll([job_id]).get(job_id)
        except SourceUnavailable:
            return None
        return job_id if status is not None and status.state.active else None

    def _prepared(self, run_id: str, number: int) -> Action | None:
        with self.db.session() as s:
            return s.scalar(
                select(Action).where(
                    Action.run_id == run_id,
                    Action.attempt == number,
                    Action.kind == ActionKind.PREPARE_SUCCESSOR.value,
                )
            )

    def _mtbf(self, run_id: str, spec: RunSpec) -> tuple[float, str]:
        """(the run's MTBF estimate in seconds, why): its attempts' training time over the
        faults a remedy answered (contained ones and requeues are not failures of the job)."""
        now = self._now()
        with self.db.session() as s:
            attempts = store.get_attempts(s, run_id)
            faults = s.scalar(
                select(func.count()).select_from(Incident).where(
                    Incident.run_id == run_id,
                    Incident.remedy.is_not(None),
                    Incident.remedy.not_in([RemedyKind.NONE.value, RemedyKind.REQUEUE.value]),
                )
            ) or 0  # fmt: skip
        trained = sum(
            ((a.ended_at or now) - a.started_at).total_seconds() for a in attempts if a.started_at
        )
        prior = spec.checkpoint.mtbf_hours * 3600
        mtbf = accounting.mtbf_estimate(trained, faults, prior)
        return mtbf, f"({trained:.0f} s trained + {prior:.0f} s prior) / ({faults} faults + 1)"

    def _already_submitted(
        self, run_id: str, number: int, log_dir: Path, ignore: frozenset[str] = frozenset()
    ) -> str | None:
        """A job of a submission whose outcome was never recorded (the supervisor died),
        with its submission finished if the death came between sbatch and the job's pickle;
        none in `ignore`."""
        job_id = self._find_submitted(run_id, number, log_dir, ignore)
        if job_id is not None and self.cluster.finish_submission(job_id, log_dir):
            log.warning(f"job {job_id} was submitted without its task", extra=_ctx(run_id, number))
        return job_id

    def _find_submitted(
        self, run_id: str, number: int, log_dir: Path, ignore: frozenset[str] = frozenset()
    ) -> str | None:
        """The newest job of attempt `number` found by its name or its submitit folder, but
        none in `ignore` (a standby job the requeue did not take)."""
        try:
            ids = [j for j in self.cluster.find_jobs(job_name(run_id, number)) if j not in ignore]
        except SourceUnavailable:
            ids = []
        if ids:
            return max(ids, key=lambda j: int(str(j).split("_")[0]))  # "100" is newer than "99"
        if log_dir.is_dir():
            ids = [
                p.name
                for p in log_dir.iterdir()
                if p.is_dir() and re.fullmatch(r"\d+", p.name) and p.name not in ignore
            ]
            if ids:
                return sorted(ids, key=int)[-1]
        return None

    # ------------------------------------------------------------------ remedies

    def apply(self, ctx: ActContext, remedy: Remedy) -> bool:
        """Carry out one remedy (or resume it); True when it is done now."""
        if remedy.kind is RemedyKind.NONE:
            return True
        kind = ActionKind(remedy.kind.value)
        evidence = remedy_evidence(remedy, ctx)
        key = self._begin(ctx.run_id, ctx.attempt, kind, remedy.target, evidence)
        if key is None:
            return True
        return self._carry_out(key, ctx, remedy)

    def resume(self, action: Action, ctx: ActContext) -> bool:
        """Finish an action whose intent survived a crash, from its recorded evidence."""
        ev = action.evidence_json
        remedy = Remedy(
            kind=RemedyKind(action.kind),
            reason=str(ev.get("reason", "resumed")),
            to_step=ev.get("to_step"),
            skip_ranges=tuple(tuple(r) for r in ev.get("skip_ranges", ())),  # type: ignore[misc]
            exclude_nodes=tuple(ev.get("exclude_nodes", ())),
        )
        ctx = ActContext(**{**ctx.__dict__, "step": ev.get("step", ctx.step)})
        return self._carry_out(action.key, ctx, remedy)

    def _carry_out(self, key: str, ctx: ActContext, remedy: Remedy) -> bool:
        notify = dict(run_id=ctx.run_id, attempt=ctx.attempt, remedy=remedy.kind.value)
        if remedy.kind is RemedyKind.OBSERVE:
            self._finish(key, True, {}, f"[nightwatch] {ctx.run_id}: {remedy.reason}", **notify)
            return True
        if remedy.kind is RemedyKind.ESCALATE:
            # With the state change or not at all: a resumed escalation whose state change
            # already committed (and its message with it) is rolled back, adding no second
            # one (no autoflush: the message's row is written by the commit, if any).
            with self.db.write_session() as s, s.no_autoflush:
                text = f"[nightwatch] {ctx.run_id} NEEDS ATTENTION: {remedy.reason}"
                self.notifier.enqueue(s, key, text, **notify)
                store.transition_run(
                    s,
                    ctx.run_id,
                    RunState.NEEDS_ATTENTION,
                    reason=remedy.reason,
                    attempt=ctx.attempt,
                )
                spec = RunSpec.model_validate(store.get_run(s, ctx.run_id).spec_json)
            job = "held" if ctx.job_active and ctx.job_id else None
            if job and spec.recovery.on_escalation == "cancel":
                if not self._try_stop_job(ctx):
                    return False
                job = "cancelled"
            self._finish(key, True, {"job": job} if job else {})
            self.notifier.wake()
            return True
        with self.db.session() as s:
            run = store.get_run(s, ctx.run_id)
        if remedy.to_step:
            self._pin_checkpoint(run, remedy.to_step, ctx)
        in_job = self._in_job(ctx, remedy, run)
        moves = in_job is None or in_job.job_id != ctx.job_id  # to a new or a standby job
        if moves and not self._try_stop_job(ctx):
            return False
        updates: dict[str, Any] = {}
        if remedy.kind is RemedyKind.ROLLBACK and remedy.skip_ranges:
            updates["skip_ranges_json"] = merge_ranges([*run.skip_ranges_json, *remedy.skip_ranges])
        if remedy.kind is RemedyKind.EXCLUDE_NODE:
            excluded = {*run.excluded_nodes_json, *remedy.exclude_nodes}
            updates["excluded_nodes_json"] = sorted(excluded)
            self._exclude_nodes(run, remedy, ctx)
        # Rollbacks name their checkpoint; others may too (after a rollback, see policy; an
        # exclusion of a node that made NaN resumes from before the onset: a rollback too).
        resume = remedy.to_step
        if remedy.kind in ROLLS_BACK and resume is not None:
            updates["resume_step"] = resume
        if updates:
            with self.db.write_session() as s:
                store.update_run(s, ctx.run_id, **updates)
        if run.current_attempt == ctx.attempt and run.state is not RunState.RECOVERING:
            with self.db.write_session() as s:
                store.transition_run(
                    s, ctx.run_id, RunState.RECOVERING, reason=remedy.reason, attempt=ctx.attempt
                )
        if in_job is None:
            job_id = self.submit_attempt(
                ctx.run_id, ctx.attempt + 1, resume_step=resume, reason=remedy.reason
            )
        else:
            job_id = self.restart_in_job(ctx, in_job, resume_step=resume, reason=remedy.reason)
            if job_id is None:
                return False  # the order is not out yet: this remedy is resumed next tick
        resume_from = resume if resume is not None else ctx.resume_from
        self._finish(
            key,
            job_id is not None,
            {
                "next_attempt": ctx.attempt + 1,
                "job_id": job_id,
                "resume_from": resume_from,
                "in_job": in_job is not None,
            },
            f"[nightwatch] {ctx.run_id}: {remedy.reason}",
            **notify,
        )
        return True

    def _in_job(self, ctx: ActContext, remedy: Remedy, run: Run) -> InJob | None:
        """Where the remedy's next attempt starts inside the running job, or None to resubmit.

        Once decided, the decision stands: a remedy resumed after a crash finds its in-job
        start recorded (keyed by the next attempt) and finishes it, whatever the job looks
        like now. A job that stops soon (its successor prepared on a stop signal or a near
        time limit) is left for that successor, while SLURM holds it: a restart inside the
        ending job would not know of the signal, and would train on until SLURM kills it.
        Otherwise, on a run that allows it, while its job holds its nodes: a remedy that
        indicts no node, or a node exclusion that the job's spares can stand in for."""
        with self.db.session() as s:
            begun = s.scalar(
                select(Action).where(
                    Action.run_id == ctx.run_id,
                    Action.attempt == ctx.attempt + 1,
                    Action.kind == ActionKind.RESTART_IN_JOB.value,
                )
            )
            fleet = store.fleet_excluded_nodes(s)
        if begun is not None:
            return InJob(begun.target, tuple(begun.evidence_json.get("nodes", ())))
        successor = self._successor(ctx.run_id, ctx.attempt + 1)
        if successor is not None:
            return InJob(successor)
        if remedy.kind is RemedyKind.REQUEUE:
            return None
        spec = RunSpec.model_validate(run.spec_json)
        if not (spec.recovery.restart_in_job and ctx.job_running and ctx.job_id):
            return None
        if remedy.kind in RESTARTS_IN_JOB:
            # with spares, every order names its nodes: the job's nodes are not all the ranks'
            return InJob(ctx.job_id, ctx.attempt_nodes if spec.resources.spare_nodes else ())
        if remedy.kind is RemedyKind.EXCLUDE_NODE and spec.resources.spare_nodes:
            excluded = [*run.excluded_nodes_json, *fleet]  # the run's and an operator's
            nodes = swap_in_spares(ctx.attempt_nodes, ctx.job_nodes, remedy.exclude_nodes, excluded)
            if nodes is not None:
                return InJob(ctx.job_id, nodes)
        return None

    def restart_in_job(
        self, ctx: ActContext, where: InJob, *, resume_step: int | None, reason: str
    ) -> str | None:
        """Start attempt `ctx.attempt + 1` inside the running job, exactly once: end the
        current attempt, record the next one on the same job, then publish the order its
        node tasks act on (each step idempotent). Returns the job id."""
        number, job_id = ctx.attempt + 1, where.job_id
        with self.db.session() as s:
            run = store.get_run(s, ctx.run_id)
        skips = tuple((int(a), int(b)) for a, b in merge_ranges(run.skip_ranges_json))
        evidence = {
            "job_id": job_id,
            "reason": reason,
            "resume_step": resume_step,
            "skip_ranges": [list(r) for r in skips],
            "nodes": list(where.nodes),
        }
        key = self._begin(ctx.run_id, number, ActionKind.RESTART_IN_JOB, job_id, evidence)
        if key is None:
            return job_id
        with self.db.write_session() as s:
            attempt = _attempt(s, ctx.run_id, ctx.attempt)
            if attempt is not None and attempt.ended_at is None:
                store.update_attempt(
                    s,
                    ctx.run_id,
                    ctx.attempt,
                    state=AttemptState.CANCELLED,
                    end_reason=f"restarted inside job {job_id}",
                    ended_at=self._now(),
                )
            if run.current_attempt < number:
                store.create_attempt(
                    s,
                    ctx.run_id,
                    executor=self.cluster.kind,
                    job_id=job_id,
                    resume_step=resume_step,
                    skip_ranges=[list(r) for r in skips],
                    nodes=list(where.nodes),
                )
        spec = RunSpec.model_validate(run.spec_json)
        mtbf = self._mtbf(ctx.run_id, spec) if spec.checkpoint.interval_auto else None
        order = RestartOrder(
            attempt=number,
            log_dir=str(attempt_log_dir(self.config.home, ctx.run_id, number)),
            resume_step=resume_step,
            skip_ranges=skips,
            mtbf_seconds=mtbf[0] if mtbf else None,
            nodes=where.nodes,
        )
        control = job_control_dir(run_dir(self.config.home, ctx.run_id), job_id)
        try:
            path = write_order(control, order)
        except OSError as exc:  # the intent stays: the next tick's resume writes it again
            log.warning(f"restart order failed: {exc}", extra=_ctx(ctx.run_id, number))
            return None
        self._finish(key, True, {"job_id": job_id, "order": str(path)})
        log.info("restarted inside the job", extra={**_ctx(ctx.run_id, number), "job_id": job_id})
        return job_id

    def _pin_checkpoint(self, run: Run, step: int, ctx: ActContext) -> None:
        """Pin the checkpoint a remedy resumes from before stopping the job: until SLURM kills
        it, that job saves and prunes on, and with a short interval it would delete the very
        checkpoint the next attempt needs (the next attempt would then fall back further)."""
        try:
            checkpoints.pin(self._checkpoint_root(run), step)
        except OSError as exc:  # the resume still falls back to an older checkpoint
            log.warning(f"pin of step {step} failed: {exc}", extra=_ctx(ctx.run_id, ctx.attempt))

    def _clear_pins(self, run_id: str, attempt: int) -> None:
        """A finished run resumes no more: its pinned checkpoints may go with retention."""
        with self.db.session() as s:
            run = store.get_run(s, run_id)
        try:
            checkpoints.unpin_below(self._checkpoint_root(run))
        except OSError as exc:
            log.warning(f"clearing checkpoint pins failed: {exc}", extra=_ctx(run_id, attempt))

    def _checkpoint_root(self, run: Run) -> Path:
        return checkpoint_dir(self.config.home, run.id, RunSpec.model_validate(run.spec_json))

    def _try_stop_job(self, ctx: ActContext) -> bool:
        """`_stop_job`, False (logged) when SLURM could not be asked: the action is retried."""
        try:
            self._stop_job(ctx)
        except SourceUnavailable as exc:
            log.warning(f"cancel failed, will retry: {exc}", extra=_ctx(ctx.run_id, ctx.attempt))
            return False
        return True

    def _stop_job(self, ctx: ActContext) -> None:
        if ctx.job_id and ctx.job_active:
            self._cancel(ctx.run_id, ctx.job_id)
        with self.db.write_session() as s:
            attempt = _attempt(s, ctx.run_id, ctx.attempt)
            if attempt is not None and attempt.ended_at is None:
                fields: dict[str, Any] = {"ended_at": self._now()}
                if ctx.job_active:
                    fields.update(state=AttemptState.CANCELLED, end_reason="cancelled by watchdog")
                store.update_attempt(s, ctx.run_id, ctx.attempt, **fields)

    def _cancel(self, run_id: str, job_id: str) -> None:
        """Cancel `job_id`, having first asked its ranks to leave at their next step should
        they be training on through a stop signal (`contracts.restart.request_leave`): the
        cancel's own TERM is then no grace to train through."""
        with contextlib.suppress(OSError):  # the cancel's TERM still stops them, later
            request_leave(job_control_dir(run_dir(self.config.home, run_id), job_id))
        with self._side_effect():
            self.cluster.cancel(job_id)

    def _exclude_nodes(self, run: Run, remedy: Remedy, ctx: ActContext) -> None:
        spec = RunSpec.model_validate(run.spec_json)
        for node in remedy.exclude_nodes:
            with self.db.write_session() as s:
                store.set_node_health(s, node, NodeHealth.EXCLUDED, remedy.reason, strike=True)
            if spec.recovery.drain_excluded_nodes:
                try:
                    with self._side_effect():
                        self.cluster.drain(node, f"{DRAIN_REASON_PREFIX} {remedy.reason}"[:200])
                except (SourceUnavailable, Unsupported) as exc:
                    log.warning(f"drain {node} failed: {exc}", extra=_ctx(ctx.run_id, ctx.attempt))

    def node_action(self, action: NodeAction) -> bool:
        """Carry out an operator's exclude / restore of a node, whose intent (with evidence)
        the API recorded; True when it is done. A restore first resumes the node in SLURM if
        Nightwatch drained it (asked of SLURM each time, so a supervisor killed after the
        resume does not resume it twice); the node's change and the outcome are one commit."""
        undrained = False
        if action.kind is NodeActionKind.RESTORE:
            try:
                undrained = self._undrain(action.node)
            except SourceUnavailable as exc:
                log.warning(f"restore of {action.node} waits for SLURM: {exc}")
                return False
        fence = self.lease.fence if self.lease is not None else None
        with self.db.write_session() as s:
            done = store.finish_node_action(
                s, action.key, self._now(), fence=fence, undrained=undrained
            )
        if done is not None:
            log.info(f"node {action.node}: {action.kind.value} by {action.requested_by}")
        return True

    def _undrain(self, node: str) -> bool:
        """Resume `node` in SLURM when Nightwatch drained it; whether it did."""
        try:
            info = self.cluster.nodes().get(node)
        except Unsupported:  # the local executor drains nothing
            return False
        if info is None or not info.drained or not info.reason.startswith(DRAIN_REASON_PREFIX):
            return False
        with self._side_effect():
            self.cluster.resume_node(node)
        return True

    def cancel_run(self, run_id: str, attempt: int, job_id: str | None, active: bool) -> bool:
        """A user's cancel request: stop the job, then the run is CANCELLED, and what was in
        flight for it is abandoned (a job it may have left unrecorded is found by its name
        and cancelled by `cancel_stray`, every tick)."""
        key = self._begin(run_id, attempt, ActionKind.CANCEL, job_id or "-", {"job_id": job_id})
        if key is None:
            return True
        try:
            if job_id and active:
                self._cancel(run_id, job_id)
        except SourceUnavailable as exc:
            log.warning(f"cancel failed, will retry: {exc}", extra=_ctx(run_id, attempt))
            return False
        with self.db.write_session() as s:
            row = _attempt(s, run_id, attempt)
            if active and row is not None and row.ended_at is None:  # the job this cancel stopped
                store.update_attempt(
                    s,
                    run_id,
                    attempt,
                    ended_at=self._now(),
                    state=AttemptState.CANCELLED,
                    end_reason="cancelled by user",
                )
            store.transition_run(
                s, run_id, RunState.CANCELLED, reason="cancelled by user", attempt=attempt
            )
        self._clear_pins(run_id, attempt)
        self._finish(key, True, {})
        with self.db.write_session() as s:
            store.abandon_actions(s, run_id, "run cancelled")
        return True

    def cancel_stray(self, run_id: str, attempt: int, job_id: str, reason: str) -> None:
        """Cancel a live job its run must not have (the run ended, or the job is not its
        attempt's): recorded once, and cancelled again while SLURM still lists it."""
        evidence = {"job_id": job_id, "reason": reason}
        key = self._begin(run_id, attempt, ActionKind.CANCEL, job_id, evidence)
        log.warning(f"cancelling job {job_id}: {reason}", extra=_ctx(run_id, attempt))
        try:
            self._cancel(run_id, job_id)
        except SourceUnavailable as exc:
            log.warning(f"cancel failed, will retry: {exc}", extra=_ctx(run_id, attempt))
            return
        if key is not None:
            self._finish(key, True, {"job_id": job_id})

    def close_leftover(self, key: str, kind: str, target: str) -> None:
        """Finish an action a crash left unfinished on a run that ended: the cancel (its job
        no longer live) or completion that ended it took effect; anything else is abandoned."""
        if kind in (ActionKind.CANCEL.value, ActionKind.COMPLETE.value):
            self._finish(key, True, {"job_id": None if target == "-" else target})
        else:
            self._finish(key, False, {"abandoned": "run ended"})

    def complete_run(self, run_id: str, attempt: int, step: int) -> None:
        key = self._begin(run_id, attempt, ActionKind.COMPLETE, str(step), {"step": step})
        if key is None:
            return
        with self.db.write_session() as s:
            store.transition_run(
                s,
                run_id,
                RunState.SUCCEEDED,
                reason=f"reached step {step}",
                attempt=attempt,
                last_step=step,
            )
        self._clear_pins(run_id, attempt)
        text = f"[nightwatch] {run_id} succeeded at step {step}"
        self._finish(key, True, {}, text, run_id=run_id)


def _attempt(session: Session, run_id: str, number: int) -> Attempt | None:
    return session.scalar(select(Attempt).where(Attempt.run_id == run_id, Attempt.number == number))


def _ctx(run_id: str, attempt: int) -> dict[str, Any]:
    return {"run_id": run_id, "attempt": attempt}
