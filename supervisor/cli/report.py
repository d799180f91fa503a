"""`nightwatch report RUN`: the overnight report, fetched from the API and rendered here."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from supervisor.cli._app import app
from supervisor.cli._common import Api, JsonOption, echo_json, fail


class ReportFormat(StrEnum):
    text = "text"
    json = "json"


class PlotAxis(StrEnum):
    step = "step"
    wall = "wall"


@app.command()
def report(
    run_id: Annotated[str, typer.Argument(help="Run id (r-…).")],
    output_format: Annotated[
        ReportFormat,
        typer.Option("--format", help="text: one screen; json: everything (as --json)."),
    ] = ReportFormat.text,
    plot: Annotated[
        Path | None,
        typer.Option(help="Also write a PNG: loss over steps, incidents, rollback/skipped data."),
    ] = None,
    plot_x: Annotated[
        PlotAxis,
        typer.Option("--plot-x", help="step: against steps; wall: against wall time (downtime)."),
    ] = PlotAxis.step,
    as_json: JsonOption = False,
) -> None:
    """What happened to a run: timeline of faults, detections, remedies; downtime; ETTR."""
    from supervisor.report import Report, render_text

    body = Api().json("GET", f"/v1/runs/{run_id}/report")
    if as_json or output_format is ReportFormat.json:
        echo_json(body)
    else:
        typer.echo(render_text(Report.from_dict(body)), nl=False)
    if plot is not None:
        try:
            from supervisor.report_plot import render_png
        except ImportError as exc:
            fail(f"--plot needs matplotlib: pip install 'nightwatch[plot]' ({exc})")
        render_png(Report.from_dict(body), plot, x=plot_x.value)
        typer.echo(f"plot written to {plot}", err=True)
