"""Runs: submit (idempotent), list, inspect, cancel, and the events timeline."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import (
    APIRouter,
    Body,
    Header,
    HTTPException,
    Path,
    Query,
    Request,
    Response,
    status,
)
from pydantic import BaseModel

from contracts.spec import RunSpec
from supervisor import store
from supervisor.api.admission import admit
from supervisor.api.deps import (
    ReadToken,
    SessionDep,
    SubmitToken,
    WriteSessionDep,
    authorize_run_write,
)
from supervisor.api.errors import LayoutRejected
from supervisor.api.examples import SPEC_EXAMPLES
from supervisor.api.schemas import (
    MAX_ATTEMPT,
    RUN_ID_PATTERN,
    RUN_NAME_PATTERN,
    AttemptOut,
    ErrorBody,
    EventOut,
    EventPage,
    RunDetail,
    RunOut,
    RunPage,
)
from supervisor.api.submissions import SubmissionWriter
from supervisor.auth import RunWrite
from supervisor.layout import layout_report
from supervisor.models import RunState

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Body is not decodable JSON"},
    401: {"model": ErrorBody, "description": "Missing or unknown token"},
    403: {"model": ErrorBody, "description": "Token lacks the scope, or the run is not its own"},
    422: {"model": ErrorBody, "description": "Invalid input; `problems` names the fields"},
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such run"}
}

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=ERRORS)

MAX_EVENT_ID = MAX_ATTEMPT  # events.id is a 32-bit integer column
RunId = Annotated[str, Path(pattern=RUN_ID_PATTERN, examples=["r-3f9a0c12d4e5"])]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=RunOut,
    responses={
        201: {
            "description": "Run stored as pending; the reconciler submits it",
            "headers": {
                "Location": {"description": "URL of the run", "schema": {"type": "string"}}
            },
        },
        200: {"model": RunOut, "description": "Retry of an earlier request with the same key"},
        403: {
            "model": ErrorBody,
            "description": "Token lacks the scope, or the spec has "
            "faults / node draining and the token is not admin",
        },
        409: {
            "model": ErrorBody,
            "description": "Idempotency-Key reused by its owner with another spec, "
            "or checkpoint.dir in use by another run",
        },
    },
)
async def submit_run(
    spec: Annotated[RunSpec, Body(openapi_examples=SPEC_EXAMPLES)],
    request: Request,
    caller: SubmitToken,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            min_length=1,
            max_length=200,
            pattern=r"^[\x21-\x7e]+$",
            description="Retries with the same key and body return the same run.",
        ),
    ] = None,
) -> Any:
    """Validate the spec and its layout, then store the run (state `pending`).

    Async: validation is CPU work either way, and the insert goes to the process's
    submission writer (`supervisor.api.submissions`), which commits waiting requests
    together."""
    if caller.run_id is not None:
        raise HTTPException(403, "a per-run worker token cannot submit runs")
    spec = await admit(spec, caller, request.app.state.settings)
    report = layout_report(spec)
    if not report.ok:
        raise LayoutRejected(report.errors)
    writer: SubmissionWriter = request.app.state.submissions
    run, created = await writer.submit(
        spec, created_by=caller.token_id, idempotency_key=idempotency_key, owner=caller.owner
    )
    return _json(
        run,
        status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        {"Location": f"/v1/runs/{run.id}"},
    )


def _json(body: BaseModel, code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """Serialize in the worker thread; FastAPI would re-validate a returned model first."""
    return Response(body.model_dump_json(), code, headers, media_type="application/json")


@router.get("", response_model=RunPage)
def list_runs(
    session: SessionDep,
    _: ReadToken,
    state: Annotated[list[RunState] | None, Query(description="Repeat to match any.")] = None,
    name: Annotated[str | None, Query(pattern=RUN_NAME_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
) -> Any:
    """Runs, newest first, filtered by state and/or exact name."""
    page = store.list_runs(session, states=state or (), name=name, limit=limit, offset=offset)
    more = offset + len(page.items) < page.total
    return RunPage(
        items=[RunOut.model_validate(r) for r in page.items],
        total=page.total,
        limit=limit,
        offset=offset,
        next_offset=offset + len(page.items) if more and page.items else None,
    )


@router.get("/{run_id}", response_model=RunDetail, responses=NOT_FOUND)
def get_run(run_id: RunId, session: SessionDep, _: ReadToken) -> Any:
    """One run with its attempts."""
    run, attempts = store.run_with_attempts(session, run_id)
    detail = RunDetail.model_validate(run).model_copy(
        update={"attempts": [AttemptOut.model_validate(a) for a in attempts]}
    )
    return _json(detail)


@router.post("/{run_id}/cancel", response_model=RunOut, responses={
    **NOT_FOUND, 409: {"model": ErrorBody, "description": "Run already finished"}
})  # fmt: skip
def cancel_run(run_id: RunId, session: WriteSessionDep, caller: SubmitToken) -> Any:
    """Cancel: immediate for a pending run, otherwise `cancel_requested` for the reconciler.
    Only the run's owner or admin may (never a worker token)."""
    authorize_run_write(session, caller, run_id, RunWrite.CANCEL)
    return store.request_cancel(session, run_id)


@router.get("/{run_id}/events", response_model=EventPage, responses=NOT_FOUND)
def run_events(
    run_id: RunId,
    session: SessionDep,
    _: ReadToken,
    after: Annotated[int, Query(ge=0, le=MAX_EVENT_ID, description="Last event id seen.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Any:
    """Timeline: state changes, incidents, action intents and outcomes, with evidence."""
    events = store.list_events(session, run_id, after=after, limit=limit)
    return EventPage(
        items=[EventOut.model_validate(e) for e in events],
        next_after=events[-1].id if events else None,
    )
