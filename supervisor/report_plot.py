"""The report as a picture: loss over steps, incidents marked, rollback and skipped data shaded,
the validation loss (when the run evaluates) as squares per attempt.

Kept apart from `supervisor.report` so the API and the text report never import matplotlib;
only `nightwatch report --plot` does. Builds a bare `Figure` (no pyplot, so no GUI backend and
no global figure state on a login node without a display).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from supervisor.metrics_in import LossPoint
from supervisor.report import TIMED_SOURCES, Report

_WINDOW_STYLE = {
    "rollback": {"color": "tab:orange", "alpha": 0.18},
    "skipped": {"color": "tab:red", "alpha": 0.28, "hatch": "//"},
}


def _by_attempt(points: list[LossPoint]) -> dict[int | None, list[LossPoint]]:
    groups: dict[int | None, list[LossPoint]] = {}
    for p in points:
        groups.setdefault(p.attempt, []).append(p)
    return groups


def render_png(
    report: Report, path: Path, *, dpi: int = 110, x: Literal["step", "wall"] = "step"
) -> Path:
    """Write the plot to `path`; one line per attempt so a replayed stretch shows as such.
    `x="wall"` draws against wall time instead, where the time no attempt trained shows."""
    fig = Figure(figsize=(10, 5), dpi=dpi)
    ax = fig.add_subplot()
    if x == "wall":
        _wall(ax, report)
    else:
        _steps(ax, report)
    ettr = f"{report.ettr:.1%}" if report.ettr is not None else "-"
    ax.set_title(
        f"{report.name or report.run_id} ({report.run_id}): {report.state}, "
        f"ETTR {ettr}, {report.steps_lost} steps lost"
    )
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _wall(ax: Axes, report: Report) -> None:
    """Loss over minutes since the run started, per attempt; each incident shaded from its
    fault to its recovery, and the stretches between attempts' last and next progress grey."""
    points = sorted((p for p in report.loss if p.t is not None), key=lambda p: p.t or 0.0)
    t0 = report.started_t or (points[0].t if points else 0.0) or 0.0

    def minutes(t: float) -> float:
        return (t - t0) / 60

    timed = [p for p in points if p.source in TIMED_SOURCES]
    spans = []
    for attempt, group in sorted(_by_attempt(timed).items(), key=lambda kv: kv[0] or 0):
        label = f"attempt {attempt}" if attempt is not None else "loss"
        ax.plot([minutes(p.t) for p in group], [p.loss for p in group], lw=1.4, label=label)  # type: ignore[arg-type]
        spans.append((group[0].t, group[-1].t))
    ckpts = [p for p in points if p.source == "checkpoint"]
    if ckpts:
        ax.plot([minutes(p.t) for p in ckpts], [p.loss for p in ckpts], "o",  # type: ignore[arg-type]
                color="black", ms=4, label="checkpoint")  # fmt: skip
    stood = [(a_end, b_start) for (_, a_end), (b_start, _) in itertools.pairwise(spans)]
    for i, (lo, hi) in enumerate(s for s in stood if s[1] > s[0]):  # type: ignore[operator]
        ax.axvspan(minutes(lo), minutes(hi), color="grey", alpha=0.25, lw=0,  # type: ignore[arg-type]
                   label="no progress" if i == 0 else None)  # fmt: skip
    for incident in report.incidents:
        if incident.fault_t is None:
            continue
        end = incident.recovered_t or incident.fault_t
        ax.axvspan(minutes(incident.fault_t), minutes(end), color="tab:red", alpha=0.2, lw=0)
        ax.axvline(minutes(incident.fault_t), color="tab:red", ls="--", lw=1)
        ax.annotate(
            f"{incident.kind}\n→ {incident.remedy or '?'}",
            xy=(minutes(incident.fault_t), 0), xycoords=("data", "axes fraction"),
            xytext=(3, 4), textcoords="offset points", va="bottom", fontsize=8, color="tab:red",
        )  # fmt: skip
    _validation(ax, report, lambda p: minutes(p.t or t0))
    ax.set_xlabel(f"minutes since the run started (downtime {report.downtime_s:.0f} s)")


def _steps(ax: Axes, report: Report) -> None:
    """Loss over steps, with the rollback and skipped windows shaded and incidents marked."""
    metric_points = [p for p in report.loss if p.source in TIMED_SOURCES]
    for attempt, points in sorted(_by_attempt(metric_points).items(), key=lambda kv: kv[0] or 0):
        points.sort(key=lambda p: (p.t or 0.0, p.step))
        label = f"attempt {attempt}" if attempt is not None else "loss"
        ax.plot([p.step for p in points], [p.loss for p in points], lw=1.4, label=label)
    ckpts = [p for p in report.loss if p.source == "checkpoint"]
    if ckpts:
        ax.plot(
            [p.step for p in ckpts],
            [p.loss for p in ckpts],
            "o" if metric_points else "o-",
            color="black",
            ms=4,
            label="checkpoint",
        )
    for window in report.windows:
        style = _WINDOW_STYLE[window.kind]
        ax.axvspan(window.start_step, window.end_step, label=window.label, lw=0, **style)
    for incident in report.incidents:
        if incident.onset_step is None:
            continue
        ax.axvline(incident.onset_step, color="tab:red", ls="--", lw=1)
        ax.annotate(
            f"{incident.kind}\n→ {incident.remedy or '?'}",
            xy=(incident.onset_step, 0),
            xycoords=("data", "axes fraction"),
            xytext=(3, 4),
            textcoords="offset points",
            va="bottom",
            fontsize=8,
            color="tab:red",
        )
    _validation(ax, report, lambda p: p.step)
    ax.set_xlabel("step")


def _validation(ax: Axes, report: Report, x: Callable[[LossPoint], float]) -> None:
    """The validation loss: one dashed line of squares per attempt, labelled once."""
    groups = sorted(_by_attempt(list(report.eval_loss)).items(), key=lambda kv: kv[0] or 0)
    for i, (_, points) in enumerate(groups):
        points.sort(key=lambda p: (p.t or 0.0, p.step))
        ax.plot([x(p) for p in points], [p.loss for p in points], "s--", color="tab:purple",
                ms=4, lw=1, label="validation loss" if i == 0 else None)  # fmt: skip
