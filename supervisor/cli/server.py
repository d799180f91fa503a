"""Local commands: `serve`, `db upgrade`, `token create` (they talk to the database directly)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from supervisor.cli._app import app, db_app, token_app
from supervisor.cli._common import fail, local_settings

if TYPE_CHECKING:
    from supervisor.db import Database


def _upgraded_database() -> Database:
    from sqlalchemy.exc import SQLAlchemyError

    from supervisor.db import Database

    settings = local_settings()
    db = Database(settings.db_url)
    try:
        db.upgrade()
    except SQLAlchemyError as exc:
        fail(f"database {db.engine.url.render_as_string(hide_password=True)}: "
             f"{str(exc.orig or exc).splitlines()[0]}")  # fmt: skip
    return db


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Default $NIGHTWATCH_HOST or 127.0.0.1")] = None,
    port: Annotated[int | None, typer.Option(help="Default $NIGHTWATCH_PORT or 8787")] = None,
    reconciler: Annotated[
        bool, typer.Option(help="Run the watchdog's reconcile loop in this process.")
    ] = True,
) -> None:
    """Apply migrations and run the API server (and the reconciler)."""
    import uvicorn

    from supervisor.api.app import create_app
    from supervisor.logs import configure_logging

    configure_logging()
    db = _upgraded_database()
    settings = local_settings()
    app_ = create_app(settings, database=db)
    loop = None
    if reconciler:
        from supervisor.watchdog.reconciler import build_reconciler

        loop = build_reconciler(
            settings, db, registry=app_.state.registry, supervisor_metrics=app_.state.metrics
        )
        loop.start()
    try:
        uvicorn.run(app_, host=host or settings.host, port=port or settings.port, access_log=False)
    finally:
        if loop is not None:
            loop.stop()


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Create or migrate the schema to the latest revision."""
    db = _upgraded_database()
    typer.echo(f"database {db.engine.url.render_as_string(hide_password=True)} is up to date")


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Option(help="Who uses it, e.g. ci")],
    scope: Annotated[list[str], typer.Option(help="read, submit or admin; repeatable")],
    run: Annotated[str | None, typer.Option(help="Restrict to one run (worker tokens)")] = None,
) -> None:
    """Create a token and print it once (only its hash is stored)."""
    from supervisor import store
    from supervisor.auth import Scope

    try:
        scopes = [Scope(s) for s in scope]
    except ValueError:
        fail(f"unknown scope in {scope}; use read, submit or admin")
    from sqlalchemy.exc import IntegrityError

    db = _upgraded_database()
    with db.write_session() as session:
        try:
            token, secret = store.create_token(session, name, scopes, run_id=run)
        except IntegrityError:
            fail(f"run {run} not found")
    typer.echo(f"created token {token.id} ({name}: {', '.join(token.scopes)}); "
               "it is shown only once:", err=True)  # fmt: skip
    typer.echo(secret)
