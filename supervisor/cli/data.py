"""`nightwatch data prepare`: build the Megatron indexed dataset (megatron_runs does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from supervisor.cli._app import data_app
from supervisor.cli._common import fail, local_settings


@data_app.command("prepare")
def prepare(
    input_jsonl: Annotated[
        Path | None, typer.Option("--input", help="JSONL with a `text` field; default: demo corpus")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Default $NIGHTWATCH_HOME/data/demo")] = None,
    vocab_size: Annotated[int, typer.Option(min=256)] = 4096,
) -> None:
    """Tokenize a corpus into `<prefix>.bin/.idx` plus tokenizer.json."""
    try:
        from megatron_runs.data_prep import prepare as run_prepare
    except ImportError as exc:
        fail(f"data preparation is unavailable ({exc})")
    if input_jsonl is not None and not input_jsonl.is_file():
        fail(f"{input_jsonl}: no such file")
    out_dir = out or local_settings().home / "data" / "demo"
    prepared = run_prepare(input_jsonl, out_dir, vocab_size)
    typer.echo(f"data.prefix: {prepared.prefix}")
    typer.echo(f"data.tokenizer: {prepared.tokenizer_path}")
