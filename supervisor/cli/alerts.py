"""`nightwatch alertmanager-config`: Alertmanager's file, from NIGHTWATCH_ALERT_* variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from supervisor.alert_routing import AlertRouting, render_yaml
from supervisor.cli._app import app


@app.command("alertmanager-config")
def alertmanager_config(
    out: Annotated[
        Path | None, typer.Option(help="Write here (mode 0600, atomically); default: stdout")
    ] = None,
) -> None:
    """Print Alertmanager's configuration: receivers from NIGHTWATCH_ALERT_WEBHOOK_URL and
    NIGHTWATCH_ALERT_SLACK_URL (+ _SLACK_CHANNEL), links from NIGHTWATCH_RUNBOOK_BASE_URL and
    NIGHTWATCH_GRAFANA_URL. Pages reach every receiver, tickets the webhook only."""
    routing = AlertRouting.from_env()
    text = render_yaml(routing)
    if not routing.receivers:
        typer.echo(
            "warning: no alert receiver configured (NIGHTWATCH_ALERT_WEBHOOK_URL, "
            "NIGHTWATCH_ALERT_SLACK_URL): every alert is discarded",
            err=True,
        )
    if out is None:
        typer.echo(text, nl=False)
        return
    tmp = out.with_name(f".{out.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(out)
    typer.echo(f"wrote {out} (receivers: {', '.join(routing.receivers) or 'none'})", err=True)
