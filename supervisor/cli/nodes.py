"""`nightwatch nodes` and `nightwatch node exclude|restore NODE [--reason …]` (admin)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from supervisor.cli._app import app, node_app
from supervisor.cli._common import Api, JsonOption, echo_json

ReasonOption = Annotated[str, typer.Option(help="Why (kept as the request's evidence)")]


@app.command("nodes")
def list_nodes(as_json: JsonOption = False) -> None:
    """Nodes as the supervisor knows them: health, strikes, exclusions, pending requests."""
    page = Api().json("GET", "/v1/nodes")
    if as_json:
        echo_json(page)
        return
    typer.echo(f"{'NODE':<20} {'HEALTH':<9} {'STRIKES':>7} {'FLEET':<9} {'RUNS':<5} "
               f"{'PENDING':<9} {'SINCE':<19}  REASON")  # fmt: skip
    for n in page["items"]:
        fleet = "excluded" if n["excluded"] else "-"
        pending = n["pending"]["kind"] if n["pending"] else "-"
        since = (n["since"] or "-")[:19]
        typer.echo(f"{n['name']:<20} {n['health']:<9} {n['strikes']:>7} {fleet:<9} "
                   f"{len(n['excluded_by_runs']):<5} {pending:<9} {since:<19}  "
                   f"{n['reason'] or ''}".rstrip())  # fmt: skip


def _request(node: str, kind: str, reason: str) -> dict[str, Any]:
    return Api().json("POST", f"/v1/nodes/{node}/{kind}", json={"reason": reason})


@node_app.command("exclude")
def exclude(node: str, reason: ReasonOption = "") -> None:
    """Keep every run's next submission off NODE (SLURM --exclude); running jobs go on."""
    _request(node, "exclude", reason)
    typer.echo(f"{node}: exclusion requested; the supervisor applies it at its next tick")


@node_app.command("restore")
def restore(node: str, reason: ReasonOption = "") -> None:
    """Put NODE back: no longer excluded (by the fleet or by runs), undrained if Nightwatch
    drained it."""
    _request(node, "restore", reason)
    typer.echo(f"{node}: restore requested; the supervisor applies it at its next tick")
