"""Liveness with a database check, and the supervisor's own Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from supervisor import store
from supervisor.api.deps import SessionDep
from supervisor.api.metrics_files import exposition
from supervisor.api.schemas import ErrorBody, Health

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    response_model=Health,
    responses={503: {"model": ErrorBody, "description": "Database unreachable"}},
)
def healthz(session: SessionDep) -> Any:
    try:
        session.execute(text("SELECT 1"))
    except SQLAlchemyError:
        return JSONResponse(
            {"error": "unavailable", "message": "database unreachable", "problems": []},
            status_code=503,
        )
    return Health(status="ok", database="ok")


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                     "description": "Prometheus text exposition"}},
)  # fmt: skip
def metrics(request: Request, session: SessionDep) -> Response:
    """`nightwatch_supervisor_*` metrics; run counts are read from the database per scrape."""
    state = request.app.state
    state.metrics.set_run_counts(store.count_runs_by_state(session))
    if state.metrics_dir is not None:
        return Response(exposition(state.metrics_dir), media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)
