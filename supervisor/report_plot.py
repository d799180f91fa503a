"""The report as a picture: loss over steps, incidents marked, rollback and skipped data shaded.

Kept apart from `supervisor.report` so the API and the text report never import matplotlib;
only `nightwatch report --plot` does. Builds a bare `Figure` (no pyplot, so no GUI backend and
no global figure state on a login node without a display).
"""

from __future__ import annotations

from pathlib import Path

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


def render_png(report: Report, path: Path, *, dpi: int = 110) -> Path:
    """Write the plot to `path`; one line per attempt so a replayed stretch shows as such."""
    fig = Figure(figsize=(10, 5), dpi=dpi)
    ax = fig.add_subplot()
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
    ettr = f"{report.ettr:.1%}" if report.ettr is not None else "-"
    ax.set_title(
        f"{report.name or report.run_id} ({report.run_id}): {report.state}, "
        f"ETTR {ettr}, {report.steps_lost} steps lost"
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path
