"""Pure policy: findings + run history + budgets → exactly one Remedy.

The ladder for a fault that keeps coming back, per fault family:
- numeric (NaN, loss spike, grad explosion): blame the data first (roll back before the
  onset, skip the samples); non-finite grads with a finite loss that recur after a skip
  suspect a node at once; if it recurs right after the skipped window, skip more (within
  `max_rollbacks_per_incident`); if it recurs elsewhere or the budget is spent, suspect a node;
  if it followed the job onto fresh nodes, suspect data/code: roll back if not tried, else a
  person decides.
- hang / crash: restart once; if it recurs, suspect the nodes common to every faulty attempt
  (a crash blames its node only when it recurs there in a crash loop, or in a job so wide
  that chance rarely repeats a node). A hang that names the node which never began the step
  is that node's (`cause=node`): excluded at once.
- preemption / walltime: requeue (never counted as a restart).
Budgets: restarts per window that did not hold (restart storm: the run needed another remedy
within `restart_held_steps`; failed resubmissions count, and back off),
excluded nodes per run, no progress across remedies; exhausted → ESCALATE. Sources that are
down never lead to a destructive remedy. A first submission that fails is retried after a
backoff while the restart budget lasts (`first_submit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from contracts.anomalies import merge_ranges
from contracts.spec import RecoverySpec
from supervisor.metrics_in import SourceHealth
from supervisor.watchdog.snapshot import (
    NUMERIC_FAULTS,
    Cause,
    CheckpointRef,
    Finding,
    FindingKind,
    PastRemedy,
    Remedy,
    RemedyKind,
    RunHistory,
    Snapshot,
)

#: Remedies in a row that did not move training past where the first of them was decided.
NO_PROGRESS_REMEDIES = 3
#: Chance below which two unrelated crashes would land on one node (1 / the job's nodes).
CRASH_COINCIDENCE_P = 0.05
#: Wait before resubmitting after a failed submission, doubled per failure in a row (capped).
SUBMIT_BACKOFF_S = 10.0
SUBMIT_BACKOFF_MAX_S = 300.0

_HANG_FAMILY = frozenset({FindingKind.HANG})
_CRASH_FAMILY = frozenset({FindingKind.JOB_FAILED, FindingKind.JOB_LOST})
_INFRA_CONTINUE = frozenset(
    {FindingKind.JOB_PREEMPTED, FindingKind.JOB_TIMEOUT, FindingKind.JOB_ENDED_EARLY}
)


def family(kind: FindingKind) -> frozenset[FindingKind]:
    """Findings that are the same fault seen differently (recurrence is judged per family)."""
    if kind in NUMERIC_FAULTS:
        return NUMERIC_FAULTS
    if kind in _HANG_FAMILY:
        return _HANG_FAMILY
    if kind in _CRASH_FAMILY:
        return _CRASH_FAMILY
    return frozenset({kind})


def _recent(history: RunHistory, rc: RecoverySpec, now: float) -> list[PastRemedy]:
    horizon = now - rc.restart_window_minutes * 60
    return [r for r in history.remedies if r.at >= horizon]


def _is_restart(r: PastRemedy) -> bool:
    """A resubmission that counts against the restart budget (requeues are nobody's fault)."""
    return r.kind.resubmits and r.kind is not RemedyKind.REQUEUE


def _counted_restarts(remedies: Sequence[PastRemedy]) -> list[PastRemedy]:
    return [r for r in remedies if _is_restart(r)]


def _storm_restarts(
    history: RunHistory, rc: RecoverySpec, now: float, step: int | None
) -> list[PastRemedy]:
    """Counted restarts in the window that did not hold: another remedy was needed before the
    run trained `restart_held_steps` past the step the restart was decided at (`step` is the
    run's step now). Restarts that each cured a different fault are the supervisor working;
    only ones that keep failing are a storm. A failed submission never holds."""
    horizon = now - rc.restart_window_minutes * 60
    return [r for r in _not_held(history, rc, step) if r.at >= horizon and _is_restart(r)]


def _not_held(history: RunHistory, rc: RecoverySpec, step: int | None) -> list[PastRemedy]:
    """Remedies after which the run needed another before training `restart_held_steps`
    past the step each was decided at (`step`: the run's step now)."""
    remedies = history.remedies
    out = []
    for i, r in enumerate(remedies):
        next_step = remedies[i + 1].step if i + 1 < len(remedies) else step
        held = (
            not r.failed
            and r.step is not None
            and next_step is not None
            and next_step - r.step >= rc.restart_held_steps
        )
        if not held:
            out.append(r)
    return out


def restarts_in_window(history: RunHistory, rc: RecoverySpec, now: float, step: int | None) -> int:
    """Restarts counted against the budget in the current window."""
    return len(_storm_restarts(history, rc, now, step))


def budget_left(
    history: RunHistory, rc: RecoverySpec, now: float, step: int | None, remedy: Remedy
) -> int:
    """Restarts left in the window once `remedy` is applied (for the budget gauge)."""
    used = restarts_in_window(history, rc, now, step) + int(remedy.kind.resubmits)
    return max(0, rc.max_restarts - used)


def resume_point(remedy: Remedy, resume_step: int | None, disk_step: int | None) -> Remedy:
    """A run rolled back once resumes every later resubmission from a named checkpoint (the
    newest trusted one, 0 when none): its newer checkpoints may hold state the rollback threw
    away, so the trainer must not pick its own."""
    if resume_step is not None and remedy.kind.resubmits and remedy.to_step is None:
        return dataclasses.replace(remedy, to_step=disk_step or 0)
    return remedy


def _escalate(reason: str, finding: Finding | None, suspect: Cause = Cause.UNKNOWN) -> Remedy:
    return Remedy(RemedyKind.ESCALATE, reason, finding=finding, suspect=suspect)


def _budget_check(
    history: RunHistory, rc: RecoverySpec, now: float, step: int | None, finding: Finding
) -> Remedy | None:
    """Restart storm and no-progress cycles stop the ladder before it loops."""
    restarts = _storm_restarts(history, rc, now, step)
    if rc.max_restarts == 0:
        return _escalate(f"{finding.summary} (recovery.max_restarts is 0: no restart)", finding)
    if len(restarts) >= rc.max_restarts:
        return _escalate(
            f"restart storm: {len(restarts)} restarts in {rc.restart_window_minutes} min",
            finding,
        )
    last = _counted_restarts(history.remedies)[-NO_PROGRESS_REMEDIES:]
    if (
        len(last) == NO_PROGRESS_REMEDIES
        and step is not None
        and last[0].step is not None
        and step <= last[0].step
    ):
        return _escalate(
            f"no progress: step {step} after {NO_PROGRESS_REMEDIES} remedies from step "
            f"{last[0].step}",
            finding,
        )
    return None


def submit_backoff(history: RunHistory, attempt: int) -> float | None:
    """When `attempt` is the one whose submission failed: seconds to wait after that remedy
    before resubmitting (SUBMIT_BACKOFF_S doubled per failure in a row); None otherwise."""
    if not history.remedies or not history.remedies[-1].failed:
        return None
    if history.remedies[-1].attempt != attempt - 1:
        return None
    failures = 0
    for r in reversed(history.remedies):
        if not r.failed:
            break
        failures += 1
    return backoff_seconds(failures)


def first_submit(
    failures: int, end_reason: str | None, failed_at: float | None, now: float, rc: RecoverySpec
) -> Remedy:
    """A pending run whose first submission failed `failures` times (every attempt of a pending
    run is a failed submission, so its number counts them): RESTART (resubmit) once the backoff
    has passed, NONE while it runs, ESCALATE when the restart budget is spent, because a
    submission that always fails must not loop."""
    if failures >= rc.max_restarts:
        return _escalate(f"submission failed {failures} times: {end_reason}", None)
    due = first_submit_due(failures, failed_at, now)
    if now < due:
        return Remedy(RemedyKind.NONE, f"submission failed; resubmitting in {due - now:.0f} s")
    return Remedy(RemedyKind.RESTART, f"resubmit: {end_reason}")


def first_submit_due(failures: int, failed_at: float | None, now: float) -> float:
    """When the next try of a failed first submission is due (failed now when not recorded)."""
    return (failed_at if failed_at is not None else now) + backoff_seconds(failures)


def backoff_seconds(failures: int) -> float:
    """Pause before resubmitting after `failures` failed submissions in a row: sbatch errors
    (bad node name, partition down) rarely clear within one tick."""
    return min(SUBMIT_BACKOFF_MAX_S, SUBMIT_BACKOFF_S * 2 ** (failures - 1))


def node_suspects(finding: Finding, prior: Sequence[PastRemedy], history: RunHistory) -> list[str]:
    """Nodes that were part of every faulty attempt (and not yet excluded), worst first."""
    if finding.nodes:
        candidates = set(finding.nodes)
    else:
        candidates = set(history.attempt_nodes)
        for r in prior:
            if r.attempt_nodes:
                candidates &= set(r.attempt_nodes)
    candidates -= history.excluded_nodes
    return sorted(candidates, key=lambda n: (-history.node_strikes.get(n, 0), n))


def _exclude(
    nodes: Sequence[str],
    finding: Finding,
    history: RunHistory,
    rc: RecoverySpec,
    why: str,
    to_step: int | None = None,
) -> Remedy:
    if history.attempt_nodes:  # a name SLURM does not know makes every resubmission fail
        nodes = [n for n in nodes if n in history.attempt_nodes]
    if not nodes:
        return _escalate(f"{why}; no node left to suspect", finding, Cause.CODE)
    if history.usable_nodes is not None:
        spare = history.usable_nodes - history.excluded_nodes - set(nodes)
        if len(spare) < history.nodes_needed:
            return _escalate(
                f"{why}; no spare node to replace {', '.join(nodes)} "
                f"({len(spare)} usable, {history.nodes_needed} needed)",
                finding,
                Cause.NODE,
            )
    if len(history.excluded_nodes) + len(nodes) > rc.max_excluded_nodes:
        return _escalate(
            f"{why}; exclusion budget spent ({len(history.excluded_nodes)} of "
            f"{rc.max_excluded_nodes} nodes excluded)",
            finding,
            Cause.NODE,
        )
    return Remedy(
        RemedyKind.EXCLUDE_NODE,
        f"{why}: exclude {', '.join(nodes)}",
        finding=finding,
        suspect=Cause.NODE,
        exclude_nodes=tuple(nodes),
        to_step=to_step,
    )


def _exclude_named(
    finding: Finding, history: RunHistory, rc: RecoverySpec, to_step: int | None = None
) -> Remedy:
    """Exclude the nodes the finding itself names (those not excluded yet)."""
    nodes = [n for n in finding.nodes if n not in history.excluded_nodes]
    return _exclude(nodes, finding, history, rc, finding.summary, to_step=to_step)


def _node_ladder(
    finding: Finding,
    prior: Sequence[PastRemedy],
    history: RunHistory,
    rc: RecoverySpec,
    why: str,
) -> Remedy:
    suspects = node_suspects(finding, prior, history)
    return _exclude(suspects[:1], finding, history, rc, why)


def trusted_checkpoints(
    checkpoints: Sequence[CheckpointRef], rollbacks: Sequence[tuple[int, float | None]]
) -> list[CheckpointRef]:
    """Checkpoints a resume may use after rollbacks `(to_step, started_at of the attempt that
    resumed from it)`: one past `to_step` saved before that attempt started holds the state
    the rollback threw away (e.g. saved by the old job on its way out) and must not return."""
    return [
        c
        for c in checkpoints
        if not any(
            c.step > to_step and (started is None or c.saved_at < started)
            for to_step, started in rollbacks
        )
    ]


def rollback_target(finding: Finding, history: RunHistory) -> int:
    """Newest checkpoint at or before the last healthy step (0 = start from scratch)."""
    if finding.last_healthy_step is not None:
        limit = finding.last_healthy_step
    elif finding.first_bad_step is not None:
        limit = finding.first_bad_step - 1
    else:
        limit = -1
    steps = [c.step for c in history.checkpoints if c.step <= limit]
    return max(steps, default=0)


def _rollback(
    finding: Finding,
    history: RunHistory,
    rc: RecoverySpec,
    global_batch: int,
    why: str,
    min_skip: int = 0,
) -> Remedy:
    skips = skip_ranges(finding, rc, global_batch, min_skip)
    to_step = rollback_target(finding, history)
    shown = ", ".join(f"[{a}, {b})" for a, b in skips)
    return Remedy(
        RemedyKind.ROLLBACK,
        f"{why}: roll back to step {to_step}" + (f", skip samples {shown}" if skips else ""),
        finding=finding,
        suspect=Cause.DATA,
        to_step=to_step,
        skip_ranges=skips,
    )


def skip_ranges(
    finding: Finding, rc: RecoverySpec, global_batch: int, min_skip: int = 0
) -> tuple[tuple[int, int], ...]:
    """What a rollback skips: the bad samples the trainer named, each followed by the spec's
    margin; else the window between the scrapes around the onset and `rollback_skip_steps`
    steps more. At least `min_skip` samples from the window's start when the bad data ran on
    past an earlier skip."""
    if finding.bad_samples:
        margin = rc.skip_margin_samples
        ranges = merge_ranges((a, b + margin) for a, b in finding.bad_samples)
        lo, hi = ranges[0][0], ranges[-1][1]
        if hi - lo < min_skip:
            ranges = merge_ranges([*ranges, (lo, lo + min_skip)])
        return ranges
    if finding.sample_window is None:
        return ()
    lo, hi = finding.sample_window
    return ((lo, max(hi + rc.rollback_skip_steps * global_batch, lo + min_skip)),)


def _adjoins_skips(finding: Finding, remedies: Sequence[PastRemedy], global_batch: int) -> bool:
    """The new bad window reaches past the end of an earlier skip, from inside or right
    after it: the bad data runs on. (Its start may lie before the skip: the last healthy
    sample can be one from before the resume point, whose window spans the skip.)"""
    if finding.sample_window is None:
        return False
    lo, hi = finding.sample_window
    return any(
        lo <= s_hi + global_batch and hi > s_hi and s_lo < hi
        for r in remedies
        for s_lo, s_hi in r.skip_ranges
    )


def _numeric(
    finding: Finding,
    prior: Sequence[PastRemedy],
    history: RunHistory,
    rc: RecoverySpec,
    global_batch: int,
) -> Remedy:
    if finding.cause is Cause.NODE and finding.nodes:
        if _pinned_again_at_same_data(finding, prior):
            # The last exclusion did not stop it: the same steps made NaN on another node,
            # so it is the data (one data-parallel shard's batch), not a node.
            return _rollback(
                finding,
                history,
                rc,
                global_batch,
                "non-finite gradients followed the same data to another node",
            )
        # Named by the node's own gradients: exclude it at once, and resume from before
        # the onset (a bf16 optimizer without a found-inf check may have applied the NaN).
        return _exclude_named(finding, history, rc, to_step=rollback_target(finding, history))
    prior = _since_pinned(prior)
    if not prior:
        return _rollback(finding, history, rc, global_batch, f"{finding.kind.value}")
    last = prior[-1]
    rollbacks = [r for r in prior if r.kind is RemedyKind.ROLLBACK]
    trailing = 0
    for r in reversed(prior):
        if r.kind is not RemedyKind.ROLLBACK:
            break
        trailing += 1
    if last.kind is RemedyKind.ROLLBACK:
        if (
            finding.kind is FindingKind.NONFINITE
            and finding.evidence.get("grads_only")
            and last.skip_ranges
        ):
            # Bad data makes the loss non-finite too; finite loss with NaN grads right after
            # skipping their window (it "continues" only because training reached that step
            # again) is a node's backward pass.
            return _node_ladder(
                finding,
                prior,
                history,
                rc,
                "non-finite grads recurred after their data window was skipped: suspect a node",
            )
        if _adjoins_skips(finding, rollbacks, global_batch):
            if trailing < rc.max_rollbacks_per_incident:
                # The bad window is longer than the skip: skip at least twice as much again.
                last_len = max((hi - lo for lo, hi in last.skip_ranges), default=0)
                return _rollback(
                    finding,
                    history,
                    rc,
                    global_batch,
                    "bad data continues past the skip",
                    min_skip=2 * last_len,
                )
            why = f"{trailing} rollbacks did not cure {finding.kind.value}: suspect a node"
        else:
            why = f"{finding.kind.value} recurred at other data after a rollback: suspect a node"
            if not node_suspects(finding, prior, history):
                if trailing < rc.max_rollbacks_per_incident:
                    # No node was in every faulty attempt: not a node's doing, a new window.
                    return _rollback(
                        finding,
                        history,
                        rc,
                        global_batch,
                        f"{finding.kind.value} at other data on other nodes",
                    )
                why = f"{trailing} rollbacks did not cure {finding.kind.value} on any node"
        return _node_ladder(finding, prior, history, rc, why)
    if last.kind is RemedyKind.EXCLUDE_NODE:
        faulty = [r for r in prior if r.attempt_nodes]
        suspects = node_suspects(finding, faulty, history)
        if suspects:
            return _exclude(
                suspects[:1], finding, history, rc, f"{finding.kind.value} persists on a node"
            )
        if not rollbacks:
            return _rollback(
                finding, history, rc, global_batch, "fault followed the job to new nodes"
            )
        return _escalate(
            f"{finding.kind.value} followed the job to new nodes after rollback: data or code",
            finding,
            Cause.CODE,
        )
    return _rollback(finding, history, rc, global_batch, f"{finding.kind.value} after restart")


def _crash_evidence(
    prior: Sequence[PastRemedy], history: RunHistory, rc: RecoverySpec, step: int | None
) -> list[PastRemedy]:
    """Earlier crashes that say something about the node they struck: a crash the run did
    not get past (its restart did not hold), or any crash in a job so wide that chance
    would rarely put two unrelated crashes on one node. In a 2-node job, half of all
    unrelated crashes land on the node of the one before."""
    if 1 / max(1, len(history.attempt_nodes)) <= CRASH_COINCIDENCE_P:
        return list(prior)
    loops = _not_held(history, rc, step)
    return [r for r in prior if r in loops]


def _restart_then_nodes(
    finding: Finding,
    prior: Sequence[PastRemedy],
    history: RunHistory,
    rc: RecoverySpec,
    step: int | None,
) -> Remedy:
    if finding.cause is Cause.NODE and finding.nodes:
        return _exclude_named(finding, history, rc)
    if finding.cause is Cause.CODE:
        return _escalate(f"program error: {finding.summary}", finding, Cause.CODE)
    if not prior:
        return Remedy(RemedyKind.RESTART, finding.summary, finding=finding)
    if finding.kind in _CRASH_FAMILY and finding.nodes:
        # A rank crash blames its node only when it recurs there, and not by chance.
        evidence = _crash_evidence(prior, history, rc, step)
        same = [n for n in finding.nodes if any(n in r.finding_nodes for r in evidence)]
        if not same:
            return Remedy(
                RemedyKind.RESTART,
                f"{finding.summary} (no crash loop on its node)",
                finding=finding,
            )
        return _node_ladder(
            dataclasses.replace(finding, nodes=tuple(same)),
            prior,
            history,
            rc,
            f"crash recurred on {', '.join(same)}",
        )
    if finding.kind in _CRASH_FAMILY:
        # Unnamed crashes too: the nodes two unrelated crashes share in a small job are chance.
        prior = _crash_evidence(prior, history, rc, step)
        if not prior:
            return Remedy(RemedyKind.RESTART, f"{finding.summary} (no crash loop)", finding=finding)
    suspects = node_suspects(finding, prior, history)
    if not suspects:
        # No node was in every faulty attempt: like a crash on another node, not a node's fault
        # (the restart budget bounds the loop).
        return Remedy(
            RemedyKind.RESTART, f"{finding.summary} (on other nodes than before)", finding=finding
        )
    why = f"{finding.kind.value} recurred after {len(prior)} remedies"
    return _exclude(suspects[:1], finding, history, rc, why)


def decide(
    snap: Snapshot, findings: Sequence[Finding], history: RunHistory, rc: RecoverySpec
) -> Remedy:
    """The one remedy for this run now. `findings` come most urgent first (detect_all)."""
    if not findings:
        return Remedy(RemedyKind.NONE, "healthy" if _sources_up(snap) else "unknown")
    finding = findings[0]
    if snap.job.health is not SourceHealth.UP:
        return Remedy(
            RemedyKind.OBSERVE,
            f"{finding.summary}; SLURM state unknown, no destructive action",
            finding=finding,
        )
    kind = finding.kind
    if kind in _INFRA_CONTINUE or (kind is FindingKind.JOB_FAILED and finding.cause is Cause.INFRA):
        return Remedy(RemedyKind.REQUEUE, finding.summary, finding=finding, suspect=Cause.INFRA)
    if kind is FindingKind.JOB_OOM:
        return _escalate(f"out of memory: {finding.summary}", finding, Cause.CODE)
    if kind is FindingKind.JOB_NO_GPU:
        return _escalate(f"GPU job without GPUs: {finding.summary}", finding, Cause.CODE)
    if kind is FindingKind.JOB_CANCELLED:
        return _escalate("job cancelled outside nightwatch", finding)
    if kind in (FindingKind.REPLICA_MISMATCH, FindingKind.CHECKPOINT_STALL, FindingKind.EVAL_JUMP):
        return _escalate(finding.summary, finding)
    if kind in (FindingKind.CHECKPOINT_FAILURE, FindingKind.THROUGHPUT_DROP):
        return Remedy(RemedyKind.OBSERVE, finding.summary, finding=finding)
    step = _current_step(snap)
    budget = _budget_check(history, rc, snap.now, step, finding)
    if budget is not None:
        return budget
    backoff = submit_backoff(history, snap.attempt)
    if backoff is not None:
        due = history.remedies[-1].at + backoff
        if snap.now < due:
            return Remedy(
                RemedyKind.NONE, f"submission failed; resubmitting in {due - snap.now:.0f} s"
            )
        return Remedy(RemedyKind.RESTART, f"resubmit: {finding.summary}", finding=finding)
    prior = [
        r
        for r in _recent(history, rc, snap.now)
        if r.finding_kind is not None and r.finding_kind in family(kind)
    ]
    if kind in NUMERIC_FAULTS:
        return _numeric(finding, prior, history, rc, snap.global_batch_size)
    if kind is FindingKind.JOB_NODE_FAIL and finding.nodes:
        left = set(finding.nodes) <= history.excluded_nodes
        if left:  # the run had moved off the node, but SLURM ended the job with it
            why = f"{finding.summary} ({', '.join(finding.nodes)} excluded already): resubmit"
            return Remedy(RemedyKind.RESTART, why, finding=finding)
    if kind in (FindingKind.STRAGGLER, FindingKind.JOB_NODE_FAIL):
        if finding.nodes:
            return _exclude_named(finding, history, rc)
        return Remedy(RemedyKind.RESTART, finding.summary, finding=finding)
    return _restart_then_nodes(finding, prior, history, rc, step)


def _pinned_again_at_same_data(finding: Finding, prior: Sequence[PastRemedy]) -> bool:
    """A NaN pinned on a node after an earlier pinned exclusion of another node, at a step
    the excluded attempt had already reached (the rollback replays the same data)."""
    bad = finding.first_bad_step
    return bad is not None and any(
        r.kind is RemedyKind.EXCLUDE_NODE
        and r.finding_kind is FindingKind.NONFINITE
        and r.finding_nodes
        and set(finding.nodes) - set(r.finding_nodes)
        and r.step is not None
        and bad <= r.step
        for r in prior
    )


def _since_pinned(prior: Sequence[PastRemedy]) -> list[PastRemedy]:
    """Remedies after the last exclusion of a node its own evidence named: that fault was
    explained and cured, so a numeric fault after it starts a ladder of its own."""
    for i in range(len(prior) - 1, -1, -1):
        if prior[i].kind is RemedyKind.EXCLUDE_NODE and prior[i].finding_nodes:
            return list(prior[i + 1 :])
    return list(prior)


def _sources_up(snap: Snapshot) -> bool:
    return snap.job.health is SourceHealth.UP and snap.metrics.health is SourceHealth.UP


def _current_step(snap: Snapshot) -> int | None:
    latest = snap.metrics.latest
    if latest is not None and latest.step is not None:
        return latest.step
    return snap.disk_checkpoint_step
