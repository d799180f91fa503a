"""Local commands: `serve`, `db upgrade`, `token create` (they talk to the database directly)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from supervisor.cli._app import app, db_app, token_app
from supervisor.cli._common import JsonOption, echo_json, fail, local_settings

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from supervisor.db import Database
    from supervisor.metrics import SupervisorMetrics
    from supervisor.settings import Settings
    from supervisor.watchdog.reconciler import Reconciler


def _upgraded_database() -> Database:
    from sqlalchemy.exc import SQLAlchemyError

    from supervisor.db import Database

    settings = local_settings()
    db = Database(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)
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
    workers: Annotated[
        int | None,
        typer.Option(min=1, max=64, help="API processes; default $NIGHTWATCH_WORKERS or 1."),
    ] = None,
) -> None:
    """Apply migrations and run the API server (and the reconciler)."""
    import uvicorn

    from contracts.logs import UVICORN_LOG_CONFIG, configure_logging

    configure_logging()
    db = _upgraded_database()
    settings = local_settings()
    host, port, workers = host or settings.host, port or settings.port, workers or settings.workers
    if workers > 1:
        if port == 0:
            fail("--workers needs a fixed port: with port 0 each worker would pick its own")
        _serve_workers(settings, db, host, port, workers, reconciler)
        return
    from supervisor.api.app import create_app

    app_ = create_app(settings, database=db)
    loop = _start_reconciler(settings, db, app_.state.registry, app_.state.metrics, reconciler)
    _announce(settings, db, host, port, workers, loop)
    try:
        uvicorn.run(app_, host=host, port=port, access_log=False, log_config=UVICORN_LOG_CONFIG)
    finally:
        if loop is not None:
            loop.stop()


def _announce(
    settings: Settings, db: Database, host: str, port: int, workers: int, loop: Reconciler | None
) -> None:
    """One line on stderr saying what this server chose, before it starts serving."""
    metrics = settings.prometheus_url or "direct scrape of the workers (no Prometheus)"
    executor = type(loop.cluster).__name__ if loop is not None else "none (--no-reconciler)"
    typer.echo(
        f"nightwatch serving http://{host}:{port} ({workers} API process(es)); "
        f"database {db.engine.url.render_as_string(hide_password=True)}; jobs: {executor}; "
        f"metrics: {metrics}; home {settings.home}",
        err=True,
    )


def _start_reconciler(
    settings: Settings,
    db: Database,
    registry: CollectorRegistry,
    metrics: SupervisorMetrics | None,
    enabled: bool,
) -> Reconciler | None:
    if not enabled:
        return None
    from supervisor.watchdog.reconciler import build_reconciler

    loop = build_reconciler(settings, db, registry=registry, supervisor_metrics=metrics)
    loop.start()
    return loop


def _serve_workers(
    settings: Settings, db: Database, host: str, port: int, workers: int, reconciler: bool
) -> None:
    """N uvicorn worker processes for the API, the reconciler here (see api.workers_mode)."""
    import os

    from prometheus_client import CollectorRegistry

    from supervisor.api import workers_mode
    from supervisor.api.metrics_files import MetricsFileWriter

    metrics_dir = workers_mode.fresh_metrics_dir(settings.home, port)
    os.environ[workers_mode.METRICS_DIR_ENV] = str(metrics_dir)
    registry = CollectorRegistry()
    # The workers set the run counts per scrape: the reconciler must not export them twice.
    loop = _start_reconciler(settings, db, registry, None, reconciler)
    writer = MetricsFileWriter(registry, metrics_dir, settings.tick_seconds)
    writer.start()
    _announce(settings, db, host, port, workers, loop)
    try:
        workers_mode.serve(host, port, workers)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    except workers_mode.WorkerStartupFailed as exc:
        fail(f"{exc}; its error is above")
    finally:
        writer.stop()
        if loop is not None:
            loop.stop()


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Create or migrate the schema to the latest revision."""
    db = _upgraded_database()
    typer.echo(f"database {db.engine.url.render_as_string(hide_password=True)} is up to date")


#: tokens.name and tokens.owner are String(64).
MAX_TOKEN_NAME = 64


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Option(help="Who uses it, e.g. ci")],
    scope: Annotated[list[str], typer.Option(help="read, submit or admin; repeatable")],
    owner: Annotated[
        str | None,
        typer.Option(help="Person or team its runs belong to (default: the name)"),
    ] = None,
    run: Annotated[str | None, typer.Option(help="Restrict to one run (worker tokens)")] = None,
) -> None:
    """Create a token and print it once (only its hash is stored)."""
    from supervisor import store
    from supervisor.auth import Scope

    try:
        scopes = [Scope(s) for s in scope]
    except ValueError:
        fail(f"unknown scope in {scope}; use read, submit or admin")
    for option, value in (("--name", name), ("--owner", owner)):
        if value is not None and not 1 <= len(value) <= MAX_TOKEN_NAME:
            fail(f"{option} must be 1 to {MAX_TOKEN_NAME} characters")
    from sqlalchemy.exc import IntegrityError

    db = _upgraded_database()
    with db.write_session() as session:
        try:
            token, secret = store.create_token(session, name, scopes, run_id=run, owner=owner)
        except IntegrityError:
            fail(f"run {run} not found")
    typer.echo(f"created token {token.id} ({name}, owner {token.owner}: "
               f"{', '.join(token.scopes)}); it is shown only once:", err=True)  # fmt: skip
    typer.echo(secret)


@token_app.command("list")
def token_list(as_json: JsonOption = False) -> None:
    """Every token: id, name, owner, scopes, run, created, revoked (never a secret)."""
    from supervisor import store

    db = _upgraded_database()
    with db.session() as session:
        tokens = store.list_tokens(session)
    if as_json:
        echo_json([
            {"id": t.id, "name": t.name, "owner": t.owner, "scopes": list(t.scopes),
             "run": t.run_id, "created": t.created_at.isoformat(), "revoked": t.revoked}
            for t in tokens
        ])  # fmt: skip
        return
    typer.echo("id\tname\towner\tscopes\trun\tcreated\trevoked")
    for t in tokens:
        typer.echo(
            f"{t.id}\t{t.name}\t{t.owner}\t{','.join(t.scopes)}\t{t.run_id or '-'}\t"
            f"{t.created_at.isoformat(timespec='seconds')}\t{'yes' if t.revoked else 'no'}"
        )


@token_app.command("revoke")
def token_revoke(
    token: Annotated[str, typer.Argument(help="A token id (t-…), or a name: all its live tokens")],
) -> None:
    """Revoke tokens; the API stops accepting them within its token cache time."""
    from supervisor import store

    db = _upgraded_database()
    with db.write_session() as session:
        try:
            revoked = store.revoke_token(session, token)
        except store.NotFound as exc:
            fail(str(exc))
    for t in revoked:
        typer.echo(f"revoked token {t.id} ({t.name}, owner {t.owner})")
