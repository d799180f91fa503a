"""Build the FastAPI app from Settings (no globals, so tests run several apps side by side)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry

from supervisor.api import errors
from supervisor.api.routes import health, report, runs, specs, workers
from supervisor.db import Database
from supervisor.metrics import SupervisorMetrics
from supervisor.settings import Settings

log = logging.getLogger("nightwatch.api")

DESCRIPTION = """Control plane of Nightwatch: submit Megatron-Core training runs, follow them,
cancel them. Authenticate with `Authorization: Bearer <token>` (`nightwatch token create`).
Scopes: `read` ⊂ `submit` ⊂ `admin`."""


def create_app(
    settings: Settings,
    *,
    database: Database | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The API over `database` (default: one built from settings; migrations not applied)."""
    db = database or Database(settings.db_url)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
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
    app.state.registry = registry or CollectorRegistry()
    app.state.metrics = SupervisorMetrics(app.state.registry)
    errors.install(app)
    for module in (runs, specs, workers, health, report):
        app.include_router(module.router)
    app.middleware("http")(_observe)
    return app


async def _observe(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """Access log + request metrics, by route template (never headers, so never tokens)."""
    start = time.perf_counter()
    response = await call_next(request)
    elapsed = time.perf_counter() - start
    route = request.scope.get("route")
    template = getattr(route, "path", "unmatched")
    metrics: SupervisorMetrics = request.app.state.metrics
    metrics.http_requests.labels(request.method, template, str(response.status_code)).inc()
    metrics.http_duration.labels(request.method, template).observe(elapsed)
    run_id = request.path_params.get("run_id") if route is not None else None
    log.info(
        "request",
        extra={
            "method": request.method,
            "path": template,
            "status": response.status_code,
            "duration_ms": round(elapsed * 1000, 2),
            "run_id": run_id,
        },
    )
    return response
