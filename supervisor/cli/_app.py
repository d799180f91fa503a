"""The typer apps that command modules attach to (kept apart so modules import no siblings)."""

from typing import Annotated

import typer

app = typer.Typer(
    name="nightwatch",
    help="Nightwatch: launch and supervise Megatron-Core training runs on SLURM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
data_app = typer.Typer(help="Training data.", no_args_is_help=True)
node_app = typer.Typer(help="Operator actions on a node (admin).", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(node_app, name="node")
app.add_typer(token_app, name="token")
app.add_typer(data_app, name="data")


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        typer.echo(f"nightwatch {version('nightwatch')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print it."),
    ] = False,
) -> None:
    pass
