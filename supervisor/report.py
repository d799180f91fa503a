"""The overnight report: what happened to one run, computed from plain rows.

Pure on purpose: the API route reads rows from the database (and loss history from wherever
it has it) and hands them over as dicts, so every number here can be tested on recorded data.
Timestamps are unix seconds (floats). The PNG plot lives in `supervisor.report_plot`, so
the API never imports matplotlib.

Definitions (the same as the Fleet dashboard's):
- downtime: the time the run stood still between attempts, from the last step an attempt
  advanced to (as its metrics first showed it) to the next attempt's first step: the stall
  before detection, the cancel, queue wait, start-up and checkpoint load. For an active run
  whose newest attempt has not trained yet, up to `now`. Attempts without metrics points
  (history unavailable) fall back to their end and start times, which leave out the stall
  before detection and the start-up;
- steps lost: per incident as the watchdog recorded it; where none recorded it, the steps
  replayed after each restart (highest step an attempt reached minus the next one's resume step);
- ETTR (effective training-time ratio): productive time / wall, where productive time is only
  time in which steps advanced beyond the previous maximum (`accounting.productive_steps` ×
  mean step time: replayed steps, failed submissions and attempts stuck at one step add
  nothing) and wall runs from the first attempt's start to the run's end (or `now`).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from supervisor import accounting
from supervisor.metrics_in.types import LossPoint

Row = Mapping[str, Any]


@dataclass(frozen=True)
class ReportData:
    """Everything the report is built from; rows are the DB rows as plain dicts."""

    run: Row
    attempts: Sequence[Row] = ()
    incidents: Sequence[Row] = ()
    actions: Sequence[Row] = ()
    checkpoints: Sequence[Row] = ()
    loss: Sequence[LossPoint] = ()
    #: The validation loss (the trainer's `eval` lines), source "eval".
    eval_loss: Sequence[LossPoint] = ()
    global_batch_size: int = 1
    now: float = 0.0


@dataclass(frozen=True)
class TimelineEntry:
    t: float
    what: str  # attempt, fault, detected, action, recovered, state
    text: str


@dataclass(frozen=True)
class IncidentLine:
    id: int | None
    kind: str
    attempt: int | None
    fault_t: float | None
    detected_t: float | None
    recovered_t: float | None
    remedy: str | None
    state: str
    onset_step: int | None
    steps_lost: int | None
    detection_latency_s: float | None
    mttr_s: float | None


@dataclass(frozen=True)
class Window:
    """A span of steps to mark on the plot: replayed after a rollback, or skipped data."""

    kind: str  # "rollback" or "skipped"
    start_step: int
    end_step: int
    label: str


@dataclass(frozen=True)
class Report:
    run_id: str
    name: str
    state: str
    state_reason: str | None
    last_step: int | None
    target_steps: int | None
    started_t: float | None
    ended_t: float | None
    wall_s: float
    downtime_s: float
    steps_lost: int
    mean_step_s: float | None
    ettr: float | None
    attempts: int
    nodes_excluded: list[str]
    skip_ranges: list[list[int]]
    incidents: list[IncidentLine]
    timeline: list[TimelineEntry]
    windows: list[Window]
    loss: list[LossPoint] = field(default_factory=list)
    eval_loss: list[LossPoint] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False, default=_json_default)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        """Inverse of `to_dict`: the CLI renders text and plots from the API's JSON."""
        nested = {
            "incidents": [IncidentLine(**i) for i in data["incidents"]],
            "timeline": [TimelineEntry(**e) for e in data["timeline"]],
            "windows": [Window(**w) for w in data["windows"]],
            "loss": [LossPoint(**p) for p in data["loss"]],
            "eval_loss": [LossPoint(**p) for p in data.get("eval_loss", ())],
        }
        return cls(**{**data, **nested})


#: Loss points observed while training, with the time they were seen: the metrics' samples,
#: or the trainer's own `step` log lines when no Prometheus server keeps the samples.
TIMED_SOURCES = frozenset({"metrics", "log"})


def _json_default(value: object) -> object:
    raise TypeError(f"not JSON serialisable: {value!r}")


def _ts(value: Any) -> float | None:
    """Unix seconds from a datetime, an ISO string or a number (rows come from DB or JSON)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    if isinstance(value, str):
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        return _ts(parsed)
    return float(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _onset_step(incident: Row) -> int | None:
    evidence = incident.get("evidence") or {}
    for key in ("first_bad_step", "onset_step", "step"):
        if evidence.get(key) is not None:
            return int(evidence[key])
    if evidence.get("last_healthy_step") is not None:
        return int(evidence["last_healthy_step"]) + 1
    return None


def _span(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None


def incident_lines(incidents: Iterable[Row]) -> list[IncidentLine]:
    lines = []
    for row in incidents:
        fault, detected, recovered = (
            _ts(row.get("fault_ts")),
            _ts(row.get("detected_ts")),
            _ts(row.get("recovered_ts")),
        )
        lines.append(
            IncidentLine(
                id=_int(row.get("id")),
                kind=str(row["kind"]),
                attempt=_int(row.get("attempt")),
                fault_t=fault,
                detected_t=detected,
                recovered_t=recovered,
                remedy=row.get("remedy"),
                state=str(row.get("state") or "open"),
                onset_step=_onset_step(row),
                steps_lost=_int(row.get("steps_lost")),
                detection_latency_s=_span(fault, detected),
                mttr_s=_span(fault if fault is not None else detected, recovered),
            )
        )
    return sorted(lines, key=lambda i: (i.detected_t or 0.0, i.id or 0))


def attempt_reach(loss: Iterable[LossPoint]) -> dict[int, int]:
    """Highest step each attempt is known to have completed."""
    reach: dict[int, int] = {}
    for p in loss:
        if p.attempt is not None:
            reach[p.attempt] = max(reach.get(p.attempt, p.step), p.step)
    return reach


def replayed_steps(attempts: Sequence[Row], loss: Sequence[LossPoint]) -> list[tuple[int, int]]:
    """(resume_step, reached_step) for each restart that went back to an earlier step."""
    reach = attempt_reach(loss)
    ordered = sorted(attempts, key=lambda a: int(a["number"]))
    spans = []
    for prev, nxt in itertools.pairwise(ordered):
        reached = reach.get(int(prev["number"]))
        resume = nxt.get("resume_step")
        if reached is not None and resume is not None and reached > int(resume):
            spans.append((int(resume), reached))
    return spans


def progress_times(loss: Iterable[LossPoint]) -> dict[int, tuple[float, float]]:
    """Per attempt: when its metrics first showed a step, and when they first showed its
    highest step (where it last advanced: a hung attempt's later scrapes repeat that step)."""
    seen: dict[int, tuple[float, float, int]] = {}
    for p in sorted(loss, key=lambda p: p.t or 0.0):
        if p.attempt is None or p.t is None or p.source not in TIMED_SOURCES:
            continue
        first, advanced, top = seen.get(p.attempt, (p.t, p.t, p.step))
        if p.step > top:
            advanced, top = p.t, p.step
        seen[p.attempt] = (first, advanced, top)
    return {n: (first, advanced) for n, (first, advanced, _) in seen.items()}


def downtime_seconds(
    attempts: Sequence[Row], loss: Sequence[LossPoint], *, active: bool, now: float
) -> float:
    """The time the run stood still between attempts (see module docstring).

    An attempt the metrics never saw train (it hung at start-up, or failed to start) is part
    of the gap around it, not progress; without any metrics points at all, the attempts'
    start and end times are the only evidence."""
    progress = progress_times(loss)
    total = 0.0
    stopped: float | None = None
    for a in sorted(attempts, key=lambda a: int(a["number"])):
        n = int(a["number"])
        first, advanced = progress.get(n, (None, None))
        if not progress:
            first = _ts(a.get("started_at"))
        if stopped is not None and first is not None:
            total += max(0.0, first - stopped)
            stopped = None
        ended = _ts(a.get("ended_at"))
        if ended is not None and (stopped is None or first is not None):
            stopped = ended if advanced is None else min(advanced, ended)
    if active and stopped is not None:
        total += max(0.0, now - stopped)
    return total


def mean_step_seconds(loss: Sequence[LossPoint]) -> float | None:
    """Seconds per step while training advanced: the time between consecutive observations of
    the same attempt that moved, over the steps they moved (saves included).

    Not the median of the observations' own rates: with a save every few steps, whether a
    scrape interval holds one decides its rate, and the median of them can make a run's steps
    longer than its wall time allows (an ETTR of 1.0 beside minutes of downtime)."""
    seconds, steps = 0.0, 0
    by_attempt: dict[int | None, list[LossPoint]] = {}
    for p in loss:
        if p.t is not None and p.source in TIMED_SOURCES:
            by_attempt.setdefault(p.attempt, []).append(p)
    for points in by_attempt.values():
        points.sort(key=lambda p: p.t or 0.0)
        for a, b in itertools.pairwise(points):
            if b.step > a.step and b.t is not None and a.t is not None:
                seconds += b.t - a.t
                steps += b.step - a.step
    return seconds / steps if steps else None


def skip_windows(skip_ranges: Iterable[Sequence[int]], global_batch_size: int) -> list[Window]:
    """Skipped sample ranges as the steps that would have consumed them in a clean run."""
    gbs = max(1, global_batch_size)
    return [
        Window(
            kind="skipped",
            start_step=int(lo) // gbs + 1,
            end_step=max(int(lo) // gbs + 1, math.ceil(int(hi) / gbs)),
            label=f"skipped samples [{lo}, {hi})",
        )
        for lo, hi in skip_ranges
    ]


def _fmt_clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")


def _attempt_entries(attempts: Sequence[Row]) -> list[TimelineEntry]:
    entries = []
    for a in attempts:
        n = a["number"]
        started = _ts(a.get("started_at"))
        if started is not None:
            details = []
            if a.get("job_id"):
                details.append(f"job {a['job_id']}")
            if a.get("nodes"):
                details.append("nodes " + ",".join(a["nodes"]))
            if a.get("resume_step") is not None:
                details.append(f"resume step {a['resume_step']}")
            if a.get("skip_ranges"):
                details.append("skip " + ", ".join(f"[{lo}, {hi})" for lo, hi in a["skip_ranges"]))
            if a.get("exclude"):
                details.append("exclude " + ",".join(a["exclude"]))
            suffix = f" ({'; '.join(details)})" if details else ""
            entries.append(TimelineEntry(started, "attempt", f"attempt {n} started{suffix}"))
        ended = _ts(a.get("ended_at"))
        if ended is not None:
            why = a.get("end_reason") or (
                f"exit code {a['exit_code']}" if a.get("exit_code") is not None else ""
            )
            text = f"attempt {n} ended: {a.get('state')}" + (f" ({why})" if why else "")
            entries.append(TimelineEntry(ended, "attempt", text))
    return entries


def _incident_entries(lines: Sequence[IncidentLine]) -> list[TimelineEntry]:
    entries = []
    for i in lines:
        where = f" at step {i.onset_step}" if i.onset_step is not None else ""
        if i.fault_t is not None:
            entries.append(TimelineEntry(i.fault_t, "fault", f"{i.kind} began{where}"))
        if i.detected_t is not None:
            latency = (
                f", {format_duration(i.detection_latency_s)} after onset"
                if i.detection_latency_s is not None
                else ""
            )
            entries.append(
                TimelineEntry(i.detected_t, "detected", f"{i.kind} detected{where}{latency}")
            )
        if i.recovered_t is not None:
            lost = f", {i.steps_lost} steps lost" if i.steps_lost is not None else ""
            mttr = format_duration(i.mttr_s) if i.mttr_s is not None else "?"
            entries.append(
                TimelineEntry(i.recovered_t, "recovered", f"{i.kind} recovered (MTTR {mttr}{lost})")
            )
    return entries


def _action_entries(actions: Sequence[Row]) -> list[TimelineEntry]:
    entries = []
    for a in actions:
        t = _ts(a.get("created_at"))
        if t is None:
            continue
        target = a.get("target")
        outcome = a.get("state") or "intent"
        text = f"{a['kind']}" + (f" {target}" if target else "") + f" [{outcome}]"
        entries.append(TimelineEntry(t, "action", text))
    return entries


def assign_attempts(loss: Iterable[LossPoint], attempts: Sequence[Row]) -> list[LossPoint]:
    """Tag points that lack an attempt (checkpoint losses) with the attempt running at `t`."""
    spans = [
        (int(a["number"]), _ts(a.get("started_at")), _ts(a.get("ended_at")) or math.inf)
        for a in attempts
    ]
    out = []
    for p in loss:
        if p.attempt is None and p.t is not None:
            owner = next((n for n, lo, hi in spans if lo is not None and lo <= p.t <= hi), None)
            p = LossPoint(p.step, p.loss, owner, p.t, p.source)
        out.append(p)
    return out


def build_report(data: ReportData) -> Report:
    """The report of one run; see the module docstring for the definitions."""
    run = data.run
    state = str(run.get("state"))
    active = state in ("submitted", "running", "recovering")
    attempts = sorted(data.attempts, key=lambda a: int(a["number"]))
    lines = incident_lines(data.incidents)
    finite = [p for p in data.loss if math.isfinite(p.loss)]  # NaN is an incident, not a point
    loss = sorted(assign_attempts(finite, attempts), key=lambda p: (p.t or 0.0, p.step))

    starts = [t for a in attempts if (t := _ts(a.get("started_at"))) is not None]
    ends = [t for a in attempts if (t := _ts(a.get("ended_at"))) is not None]
    started_t = min(starts) if starts else None
    ended_t = None if active or not ends else max(ends)
    wall = max(0.0, (ended_t or data.now) - started_t) if started_t is not None else 0.0

    downtime = downtime_seconds(attempts, loss, active=active, now=data.now)
    replays = replayed_steps(attempts, loss)
    recorded = [i.steps_lost for i in lines if i.steps_lost is not None]
    steps_lost = sum(recorded) if recorded else sum(hi - lo for lo, hi in replays)
    step_s = mean_step_seconds(loss)
    reached = [p.step for p in loss] + [_int(run.get("last_step"))]
    start_step = _int(attempts[0].get("resume_step")) if attempts else None
    ettr = accounting.run_ettr(
        wall_s=wall,
        productive_steps=accounting.productive_steps(start_step, reached),
        mean_step_s=step_s,
    )

    skips = [list(r) for r in run.get("skip_ranges") or []]
    windows = [
        Window("rollback", lo, hi, f"rolled back {hi} → {lo}, replayed") for lo, hi in replays
    ] + skip_windows(skips, data.global_batch_size)

    # the watchdog records `last_step` when a run ends; until then, the newest point seen
    last_step = _int(run.get("last_step"))
    if last_step is None and loss:
        last_step = loss[-1].step

    timeline = _attempt_entries(attempts) + _incident_entries(lines)
    timeline += _action_entries(data.actions)
    if ended_t is not None:
        reason = f" ({run['state_reason']})" if run.get("state_reason") else ""
        timeline.append(TimelineEntry(ended_t, "state", f"run {state}{reason}"))
    timeline.sort(key=lambda e: e.t)

    return Report(
        run_id=str(run["id"]),
        name=str(run.get("name") or ""),
        state=state,
        state_reason=run.get("state_reason"),
        last_step=last_step,
        target_steps=_int(run.get("target_steps")),
        started_t=started_t,
        ended_t=ended_t,
        wall_s=wall,
        downtime_s=downtime,
        steps_lost=steps_lost,
        mean_step_s=step_s,
        ettr=ettr,
        attempts=len(attempts),
        nodes_excluded=sorted(set(run.get("excluded_nodes") or [])),
        skip_ranges=skips,
        incidents=lines,
        timeline=timeline,
        windows=windows,
        loss=loss,
        eval_loss=sorted(
            (p for p in data.eval_loss if math.isfinite(p.loss)), key=lambda p: (p.t or 0.0, p.step)
        ),
    )


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {sec:02d}s"
    return f"{sec}s"


def render_text(report: Report) -> str:
    """One screen: headline, numbers, timeline, incidents table."""
    progress = (
        f"step {report.last_step}/{report.target_steps}"
        if report.last_step is not None
        else f"no step yet of {report.target_steps}"
    )
    reason = f" — {report.state_reason}" if report.state_reason else ""
    ettr = f"{report.ettr:.1%}" if report.ettr is not None else "-"
    span = (
        f"{datetime.fromtimestamp(report.started_t, UTC):%Y-%m-%d %H:%M:%S} → "
        f"{_fmt_clock(report.ended_t) if report.ended_t else 'now'} UTC"
        if report.started_t is not None
        else "never started"
    )
    out = [
        f"Run {report.run_id} ({report.name}): {report.state.upper()}{reason}, {progress}",
        f"  {span}, wall {format_duration(report.wall_s)}, {report.attempts} attempt(s)",
        f"  ETTR {ettr}   downtime {format_duration(report.downtime_s)}   "
        f"steps lost {report.steps_lost}   incidents {len(report.incidents)}",
        "  nodes excluded: " + (", ".join(report.nodes_excluded) or "none"),
        "  skipped samples: "
        + (", ".join(f"[{lo}, {hi})" for lo, hi in report.skip_ranges) or "none"),
        "",
        "Timeline (UTC)",
    ]
    out += [f"  {_fmt_clock(e.t)}  {e.what:<9} {e.text}" for e in report.timeline] or ["  -"]
    if report.eval_loss:
        out += ["", "Validation loss (per attempt: its evaluations, first, best and last)"]
        out += [_eval_line(attempt, points) for attempt, points in _by_attempt(report.eval_loss)]
    if report.incidents:
        header = f"  {'kind':<20} {'remedy':<15} {'detect':<8} {'MTTR':<8} {'lost':<5} state"
        out += ["", "Incidents", header]
        for i in report.incidents:
            out.append(
                f"  {i.kind[:20]:<20} {(i.remedy or '-')[:15]:<15} "
                f"{format_duration(i.detection_latency_s):<8} {format_duration(i.mttr_s):<8} "
                f"{'-' if i.steps_lost is None else i.steps_lost:<5} {i.state}"
            )
    return "\n".join(out) + "\n"


def _by_attempt(points: Iterable[LossPoint]) -> list[tuple[int | None, list[LossPoint]]]:
    groups: dict[int | None, list[LossPoint]] = {}
    for p in points:
        groups.setdefault(p.attempt, []).append(p)
    return sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0])


def _eval_line(attempt: int | None, points: list[LossPoint]) -> str:
    """One attempt's evaluations on one line: a long run evaluates thousands of times."""
    first, last = points[0], points[-1]
    best = min(points, key=lambda p: p.loss)
    return (
        f"  attempt {'-' if attempt is None else attempt}: {len(points)} at steps "
        f"{first.step}-{last.step}, first {first.loss:.4f}, best {best.loss:.4f} "
        f"(step {best.step}), last {last.loss:.4f}"
    )


def loss_from_checkpoints(checkpoints: Iterable[Row]) -> list[LossPoint]:
    """The sparse fallback: every complete checkpoint records the loss at its step."""
    return [
        LossPoint(int(c["step"]), float(c["loss"]), None, _ts(c.get("saved_at")), "checkpoint")
        for c in checkpoints
        if c.get("complete", True) and c.get("loss") is not None and math.isfinite(c["loss"])
    ]
