"""Build the FastAPI app from Settings (no globals, so tests run several apps side by side)."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio.to_thread
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from supervisor.api import errors
from supervisor.api.limits import BodyLimit
from supervisor.api.principals import PrincipalCache
from supervisor.api.routes import health, logs, nodes, operator, report, runs, specs, workers
from supervisor.api.submissions import SubmissionWriter
from supervisor.db import REQUEST_THREADS, Database
from supervisor.metrics import SupervisorMetrics
from supervisor.metrics_in import LossPoint, loss_history
from supervisor.settings import Settings

log = logging.getLogger("nightwatch.api")

#: How long a thread may hold the GIL while another waits (Python's default: 5 ms). A request
#: thread waiting on the database gets the GIL back only when the event loop thread yields it,
#: so a POST's ten round trips could each wait out a full interval behind the loop.
GIL_SWITCH_INTERVAL_S = 0.001

#: How far back the report's loss curve reaches in Prometheus (its default retention).
LOSS_HISTORY_S = 15 * 86400

DESCRIPTION = """Control plane of Nightwatch: submit Megatron-Core training runs, follow them,
cancel them. Authenticate with `Authorization: Bearer <token>` (`nightwatch token create`).
Scopes: `read` ⊂ `submit` ⊂ `admin`."""


def create_app(
    settings: Settings,
    *,
    database: Database | None = None,
    registry: CollectorRegistry | None = None,
    metrics_dir: Path | None = None,
) -> FastAPI:
    """The API over `database` (default: one built from settings; migrations not applied).

    `metrics_dir`: this is one of several worker processes (`supervisor.api.workers_mode`),
    and /metrics merges the metric files there."""
    db = database or Database(settings.db_url, sqlite_synchronous=settings.sqlite_synchronous)

    submissions = SubmissionWriter(db)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = REQUEST_THREADS
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        _freeze_startup_objects()
        yield
        await asyncio.to_thread(submissions.close)
        if database is None:
            db.dispose()

    app = FastAPI(
        title="Nightwatch",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.db = db
    app.state.submissions = submissions
    app.state.registry = registry or CollectorRegistry()
    app.state.metrics_dir = metrics_dir
    app.state.metrics = SupervisorMetrics(app.state.registry)
    app.state.principals = PrincipalCache(settings.token_cache_seconds)
    if settings.prometheus_url:
        app.state.loss_history = functools.partial(
            _prometheus_loss_history, settings.prometheus_url
        )
    errors.install(app)
    for module in (runs, logs, operator, nodes, specs, workers, health, report):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestObserver)  # outermost: the access log sees every answer
    return app


def _freeze_startup_objects() -> None:
    """Move everything built so far (modules, the app, pydantic and SQLAlchemy machinery) out
    of the garbage collector's sight. A full collection walked all of it: 50-80 ms pauses,
    every few seconds at 500 requests/s, which set the API's p99."""
    gc.collect()
    gc.freeze()


def _prometheus_loss_history(url: str, run_id: str) -> list[LossPoint]:
    """The report's loss curve over the last LOSS_HISTORY_S (docs/contracts.md, Report)."""
    return loss_history(url, run_id, since=time.time() - LOSS_HISTORY_S)


class RequestObserver:
    """Access log + request metrics by route template (never headers, so never tokens).

    Plain ASGI rather than `@app.middleware("http")`, which costs a task and a stream per
    request.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self._record(scope, status, time.perf_counter() - start)

    @staticmethod
    def _record(scope: Scope, status: int, elapsed: float) -> None:
        route = scope.get("route")
        template = getattr(route, "path", "unmatched")
        metrics: SupervisorMetrics = scope["app"].state.metrics
        metrics.http_requests.labels(scope["method"], template, str(status)).inc()
        metrics.http_duration.labels(scope["method"], template).observe(elapsed)
        run_id = scope.get("path_params", {}).get("run_id") if route is not None else None
        log.info(
            "request",
            extra={
                "method": scope["method"],
                "path": template,
                "status": status,
                "duration_ms": round(elapsed * 1000, 2),
                "run_id": run_id,
            },
        )
