"""Findings from the trainer's own record of its bad steps (`contracts.anomalies`).

The trainer judges every step on each sample's loss and each node's gradients, so its record
dates an onset to the step and names the bad samples and nodes exactly, whatever the scrape
interval. From it:
- a spike episode (consecutive spike steps) is a LOSS_SPIKE whose skip is exactly its bad
  samples; it is judged once it is over (a later step came clean: the trainer's `clean` line,
  or a scrape of a later step; or the job ended), so the whole window is skipped at once, or
  once it has lasted WINDOW_STEPS steps (then
  `rollback_skip_steps` batches past it are skipped too); an episode of at most
  `tolerate_spike_steps` steps that is over is contained;
- non-finite steps are contained (the optimizer skipped their updates; the trainer's own budget
  bounds them), unless one node made non-finite gradients `node_nonfinite_strikes` times in the
  attempt: a NONFINITE finding naming that node;
- the trainer's stop on its budget (exit 79) is a NONFINITE finding naming the nodes, else the
  bad samples of the steps it counted, else those steps' samples;
- a node the trainer named a straggler is a STRAGGLER finding naming it, while the job runs.
Contained episodes become incidents with their evidence and no remedy (`contained`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from contracts.anomalies import (
    CLEAN,
    NONFINITE,
    SPIKE,
    STOP,
    STOP_SIGNAL,
    STRAGGLER,
    Anomaly,
    Ranges,
    merge_ranges,
)
from contracts.metric_names import WINDOW_STEPS
from contracts.spec import RecoverySpec
from supervisor.watchdog.detectors.common import job_running
from supervisor.watchdog.snapshot import Cause, Finding, FindingKind, Snapshot


@dataclass(frozen=True)
class Episode:
    """Consecutive bad steps of one kind in one attempt."""

    kind: str
    records: tuple[Anomaly, ...]

    @property
    def first(self) -> int:
        return self.records[0].step

    @property
    def last(self) -> int:
        return self.records[-1].step

    @property
    def key(self) -> str:
        return self.records[0].key

    @property
    def samples(self) -> Ranges:
        return merge_ranges(r for a in self.records for r in a.samples)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({n for a in self.records for n in a.nodes}))


def episodes(records: Sequence[Anomaly], kind: str) -> list[Episode]:
    """`kind`'s records grouped into runs of consecutive steps, oldest first."""
    out: list[list[Anomaly]] = []
    for a in sorted((r for r in records if r.kind == kind), key=lambda r: r.step):
        if out and a.step == out[-1][-1].step + 1:
            out[-1].append(a)
        elif not out or a.step > out[-1][-1].step:
            out.append([a])
    return [Episode(kind, tuple(group)) for group in out]


def _over(snap: Snapshot, episode: Episode) -> bool:
    """A later step came clean (the record of a bad one is written before the metrics show
    it): the trainer's `clean` line says so at once, a scrape of a later step a scrape
    later; or the job no longer trains."""
    latest = snap.metrics.latest
    stepped_past = latest is not None and latest.step is not None and latest.step > episode.last
    cleared = any(a.kind == CLEAN and a.step > episode.last for a in snap.anomalies)
    return stepped_past or cleared or not job_running(snap)


def _blamed_nodes(records: Sequence[Anomaly], snap: Snapshot) -> tuple[str, ...]:
    """Nodes the records name, when they single some out of the attempt's nodes (every node
    making NaN, or the only node of a one-node job, says nothing about any node). A step whose
    samples' own losses were non-finite blames its data: the nodes that computed those
    samples made the NaN gradients, through no fault of theirs."""
    named = {n for a in records if not a.samples for n in a.nodes}
    attempt = set(snap.job.nodes)
    if named and (not attempt or named < attempt):
        return tuple(sorted(named))
    return ()


def _spike_finding(episode: Episode, over: bool, snap: Snapshot, rc: RecoverySpec) -> Finding:
    """The episode's finding; one judged while it goes on also skips `rollback_skip_steps`
    batches past its last bad sample, where the rest of the window likely lies."""
    first = episode.records[0]
    bad = episode.samples
    if not over and rc.rollback_skip_steps:
        end = bad[-1][1]
        bad = merge_ranges([*bad, (end, end + rc.rollback_skip_steps * snap.global_batch_size)])
    lo, hi = bad[0][0], bad[-1][1]
    return Finding(
        kind=FindingKind.LOSS_SPIKE,
        summary=(
            f"trainer: loss spike at steps {episode.first}-{episode.last} "
            f"(loss {first.loss:.3g} > {first.threshold:.3g}), samples {_text(episode.samples)}"
        ),
        cause=Cause.DATA,
        evidence=_evidence(episode),
        fault_time=first.t,
        last_healthy_step=episode.first - 1,
        first_bad_step=episode.first,
        sample_window=(lo, hi),
        bad_samples=bad,
    )


def _evidence(episode: Episode) -> dict[str, object]:
    return {
        "source": "trainer",
        "record": episode.key,
        "steps": [a.step for a in episode.records],
        "bad_samples": [list(r) for r in episode.samples],
        "nonfinite_nodes": list(episode.nodes),
        "losses": [a.loss for a in episode.records],
        "threshold": episode.records[0].threshold,
        "updates_skipped": sum(a.update_skipped for a in episode.records),
    }


def _text(ranges: Ranges) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in ranges) or "none singled out"


def _node_strikes(records: Sequence[Anomaly], snap: Snapshot, rc: RecoverySpec) -> Finding | None:
    """A node that made non-finite gradients `node_nonfinite_strikes` times this attempt."""
    bad = [a for a in records if a.kind == NONFINITE and _blamed_nodes([a], snap)]
    strikes = Counter(n for a in bad for n in _blamed_nodes([a], snap))
    struck = tuple(sorted(n for n, k in strikes.items() if k >= rc.node_nonfinite_strikes))
    if not struck:
        return None
    mine = [a for a in bad if set(a.nodes) & set(struck)]
    return Finding(
        kind=FindingKind.NONFINITE,
        summary=(
            f"trainer: non-finite gradients from {', '.join(struck)} at steps "
            f"{', '.join(str(a.step) for a in mine)}"
        ),
        cause=Cause.NODE,
        nodes=struck,
        evidence={
            "source": "trainer",
            "steps": [a.step for a in mine],
            "nonfinite_grad_nodes": list(struck),
            "grads_only": True,
        },
        fault_time=mine[0].t,
        last_healthy_step=mine[0].step - 1,
        first_bad_step=mine[0].step,
    )


def _budget_finding(stop: Anomaly, records: Sequence[Anomaly], snap: Snapshot) -> Finding:
    """The trainer stopped on its skipped-update budget: what its counted steps blame."""
    counted = [
        a
        for a in records
        if a.kind == NONFINITE and a.update_skipped and a.step > stop.step - stop.window_steps
    ]
    nodes = _blamed_nodes(counted, snap)
    samples = merge_ranges(r for a in counted for r in a.samples)
    if not samples and not nodes:  # nothing singled out: the steps' samples are the suspects
        samples = merge_ranges(a.consumed for a in counted)
    # The onset is the blamed cause's first step: a node's NaN that tipped a budget partly
    # spent by an earlier, contained NaN batch began at the node's first strike.
    blamed = [a for a in counted if set(_blamed_nodes([a], snap)) & set(nodes)] if nodes else []
    first = (blamed or counted or [stop])[0]
    steps = [a.step for a in counted]
    why = f"nodes {', '.join(nodes)}" if nodes else f"samples {_text(samples)}"
    return Finding(
        kind=FindingKind.NONFINITE,
        summary=(
            f"trainer stopped: {stop.skipped_updates} updates skipped within "
            f"{stop.window_steps} steps (steps {steps}), {why}"
        ),
        cause=Cause.NODE if nodes else Cause.DATA,
        nodes=nodes,
        evidence={
            "source": "trainer",
            "record": stop.key,
            "steps": steps,
            "bad_samples": [list(r) for r in samples],
            "nonfinite_grad_nodes": list(nodes),
            # Finite losses, NaN gradients: a backward pass's doing (a node's, when the job
            # has one node to blame), which the ladder suspects once a skip did not cure it.
            "grads_only": bool(counted) and not any(a.samples for a in counted),
        },
        fault_time=first.t,
        last_healthy_step=first.step - 1,
        first_bad_step=first.step,
        sample_window=(samples[0][0], samples[-1][1]) if samples and not nodes else None,
        bad_samples=() if nodes else samples,
    )


def detect_skip_budget(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """The trainer's stop on its budget of skipped updates (exit 79), from its record: known
    even if no scrape saw one of those steps."""
    stops = [a for a in snap.anomalies if a.kind == STOP]
    if not stops:
        return []
    return [_budget_finding(stops[-1], snap.anomalies, snap)]


def _straggler_finding(record: Anomaly) -> Finding:
    node = record.nodes[0]
    first = max(record.step - record.window_steps + 1, 1)
    return Finding(
        kind=FindingKind.STRAGGLER,
        summary=(
            f"trainer: node {node} steps {record.ratio or 0:.2f}× slower than the others "
            f"(judged over steps {first}-{record.step})"
        ),
        cause=Cause.NODE,
        nodes=(node,),
        evidence={
            "source": "trainer",
            "record": record.key,
            "ratio": record.ratio,
            "window_steps": record.window_steps,
        },
        fault_time=record.t,
        first_bad_step=first,
    )


def detect_trainer_anomalies(snap: Snapshot, rc: RecoverySpec) -> list[Finding]:
    """Spikes over (or long), nodes past their strikes and stragglers, from the trainer's
    record."""
    out: list[Finding] = []
    node = _node_strikes(snap.anomalies, snap, rc)
    if node is not None:
        out.append(node)
    if job_running(snap):
        out += [_straggler_finding(a) for a in snap.anomalies if a.kind == STRAGGLER]
    for episode in episodes(snap.anomalies, SPIKE):
        over = _over(snap, episode)
        if over and len(episode.records) <= rc.tolerate_spike_steps:
            continue
        if over or len(episode.records) >= WINDOW_STEPS:
            out.append(_spike_finding(episode, over, snap, rc))
            break
    return out


def contained(snap: Snapshot, rc: RecoverySpec) -> list[Episode]:
    """The episodes of this attempt that are over and needed no remedy: non-finite steps no
    node is to blame for (their updates were skipped, and training went on past them), and
    tolerated spikes. One still going on may yet end in the trainer's budget stop."""
    out = []
    stops = [a for a in snap.anomalies if a.kind == STOP]
    for episode in episodes(snap.anomalies, NONFINITE):
        if not _over(snap, episode) or any(episode.last > s.step - s.window_steps for s in stops):
            continue  # going on, or counted by the trainer's stop: that finding's
        blamed = _blamed_nodes(episode.records, snap)
        strikes = Counter(
            n for a in snap.anomalies if a.kind == NONFINITE for n in _blamed_nodes([a], snap)
        )
        if not any(strikes[n] >= rc.node_nonfinite_strikes for n in blamed):
            out.append(episode)
    for episode in episodes(snap.anomalies, SPIKE):
        if _over(snap, episode) and len(episode.records) <= rc.tolerate_spike_steps:
            out.append(episode)
    return out


def unremedied_spikes(snap: Snapshot, rc: RecoverySpec) -> list[Episode]:
    """Spike episodes of this attempt beyond what the spec tolerates: at the run's end, ones
    that no remedy can follow any more."""
    return [e for e in episodes(snap.anomalies, SPIKE) if len(e.records) > rc.tolerate_spike_steps]


def explained_nonfinite(snap: Snapshot) -> int:
    """Non-finite steps of this attempt the trainer's record accounts for."""
    return sum(1 for a in snap.anomalies if a.kind == NONFINITE)


def spike_recorded_after(snap: Snapshot, step: int | None) -> bool:
    """The trainer recorded a spike at or after `step` this attempt: its exact record, not a
    scrape's view of the same steps, is what a remedy acts on."""
    return any(a.kind == SPIKE and (step is None or a.step >= step) for a in snap.anomalies)


def stopping_on_signal(snap: Snapshot) -> str | None:
    """Why this attempt will end in a requeue while its job still runs, or None: its ranks
    recorded a stop signal (walltime or preemption warning) and are saving to leave with 75.
    The next attempt's job can be prepared meanwhile (`recovery.prepare_successor`)."""
    if not job_running(snap):
        return None
    stops = [a.step for a in snap.anomalies if a.kind == STOP_SIGNAL]
    return f"the ranks stop on a signal at step {min(stops)}" if stops else None
