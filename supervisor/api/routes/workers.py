"""Worker registration (metrics endpoint + heartbeat) and Prometheus HTTP service discovery."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Response, status

from supervisor import store
from supervisor.api.deps import (
    ReadToken,
    SessionDep,
    SubmitToken,
    WriteSessionDep,
    authorize_run_write,
)
from supervisor.api.routes.runs import ERRORS, NOT_FOUND, RunId
from supervisor.api.schemas import MAX_ATTEMPT, NODE_PATTERN, EndpointIn, TargetGroup
from supervisor.auth import RunWrite

router = APIRouter(tags=["workers"], responses=ERRORS)


@router.put(
    "/v1/runs/{run_id}/attempts/{attempt}/endpoints/{node}",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses=NOT_FOUND,
)
def register_endpoint(
    run_id: RunId,
    attempt: Annotated[int, Path(ge=1, le=MAX_ATTEMPT)],
    node: Annotated[str, Path(pattern=NODE_PATTERN, examples=["n1"])],
    body: EndpointIn,
    session: WriteSessionDep,
    caller: SubmitToken,
) -> Response:
    """Called by local rank 0 of each node at start and every 10 s (the heartbeat), with the
    run's worker token; the run's owner or admin may too."""
    authorize_run_write(session, caller, run_id, RunWrite.REGISTER_ENDPOINT)
    store.register_endpoint(session, run_id, attempt, node, body.host, body.port)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/v1/prometheus/targets", response_model=list[TargetGroup])
def prometheus_targets(session: SessionDep, _: ReadToken) -> Any:
    """Prometheus `http_sd_configs` JSON for the current attempt of every active run."""
    return [
        TargetGroup(
            targets=[f"{e.host}:{e.port}"],
            labels={"run_id": e.run_id, "attempt": str(e.attempt), "node": e.node},
        )
        for e in store.active_endpoints(session)
    ]
