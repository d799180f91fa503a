"""`nightwatch logs RUN [--attempt N] [--node X] [--tail L] [--follow] [--json]`."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from supervisor.cli._app import app
from supervisor.cli._common import FINAL_STATES, Api, JsonOption, echo_json


@app.command()
def logs(
    run: str,
    attempt: Annotated[int | None, typer.Option(min=1, help="Default: the current one")] = None,
    node: Annotated[str | None, typer.Option(help="Default: the first node (rank 0's)")] = None,
    tail: Annotated[int, typer.Option(min=0, max=10_000, help="Lines to show first")] = 200,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing; move on to later attempts")
    ] = False,
    poll_seconds: Annotated[float, typer.Option(min=0.1)] = 1.0,
    as_json: JsonOption = False,
) -> None:
    """Print a node's log of a run's attempt; with --follow, what it writes next, attempt
    after attempt, until the run ends (JSON: the API's answer, or with --follow one answer
    per line, each naming its attempt, node and offset)."""
    api = Api()

    def show(chunk: dict[str, Any]) -> None:
        if as_json:
            echo_json(chunk, lines=follow)
        else:
            typer.echo(chunk["text"], nl=False)

    path = f"/v1/runs/{run}/logs"
    params: dict[str, Any] = {"tail": tail}
    if attempt is not None:
        params["attempt"] = attempt
    if node is not None:
        params["node"] = node
    chunk = api.json("GET", path, params=params)
    show(chunk)
    while follow:
        if chunk["done"] and not chunk["text"]:
            state = api.json("GET", f"/v1/runs/{run}")
            if attempt is None and state["current_attempt"] > chunk["attempt"]:
                params = {"attempt": state["current_attempt"], "offset": 0}
                if node is not None:
                    params["node"] = node
                if not as_json:
                    typer.echo(f"--- attempt {state['current_attempt']} ---")
                chunk = api.json("GET", path, params=params)
                show(chunk)
                continue
            if attempt is not None or state["state"] in FINAL_STATES:
                return
        time.sleep(poll_seconds)
        params = {"attempt": chunk["attempt"], "offset": chunk["offset"]}
        if chunk["node"] is not None:
            params["node"] = chunk["node"]
        chunk = api.json("GET", path, params=params)
        if chunk["text"]:  # JSON: no line for a poll that found nothing new
            show(chunk)
