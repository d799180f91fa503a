"""A run's task logs, read or followed by byte offset (`nightwatch logs`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request

from contracts.slurm_names import NODE_NAME_PATTERN
from supervisor import store
from supervisor.api.deps import ReadToken, SessionDep
from supervisor.api.schemas import MAX_ATTEMPT, RUN_ID_PATTERN, ErrorBody, LogChunkOut
from supervisor.run_logs import UnknownNode, read_log, task_files
from supervisor.store import NotFound

router = APIRouter(prefix="/v1/runs", tags=["runs"])

RunId = Annotated[str, Path(pattern=RUN_ID_PATTERN, examples=["r-3f9a0c12d4e5"])]


@router.get(
    "/{run_id}/logs",
    response_model=LogChunkOut,
    responses={
        401: {"model": ErrorBody, "description": "Missing or unknown token"},
        404: {"model": ErrorBody, "description": "No such run, attempt or node"},
        422: {"model": ErrorBody, "description": "Invalid input; `problems` names the fields"},
    },
)
def run_logs(
    request: Request,
    run_id: RunId,
    session: SessionDep,
    _: ReadToken,
    attempt: Annotated[
        int | None, Query(ge=1, le=MAX_ATTEMPT, description="Default: the current attempt.")
    ] = None,
    node: Annotated[
        str | None,
        Query(pattern=NODE_NAME_PATTERN, description="Default: the first node (rank 0's)."),
    ] = None,
    tail: Annotated[int, Query(ge=0, le=10_000, description="Lines, when no offset.")] = 200,
    offset: Annotated[
        int | None, Query(ge=0, description="Byte offset from an earlier answer: follow on.")
    ] = None,
) -> Any:
    """One node's log of one attempt: its last `tail` lines, or what was written after
    `offset`. Follow a run by asking again with the returned `offset` until `done`."""
    run = store.get_run(session, run_id)
    attempts = {a.number: a for a in store.get_attempts(session, run_id)}
    number = attempt or run.current_attempt
    chosen = attempts.get(number)
    if chosen is None:
        raise NotFound(f"run {run_id} has no attempt {number}")
    done = chosen.ended_at is not None
    out = {"run_id": run_id, "attempt": number, "job_id": chosen.job_id, "done": done}
    if chosen.job_id is None:
        return LogChunkOut(**out, node=None, nodes=[], text="", offset=offset or 0)
    home = request.app.state.settings.home
    files = task_files(home, run_id, number, chosen.job_id, list(chosen.nodes_json))
    try:
        chunk = read_log(files, node, tail, offset)
    except UnknownNode as exc:
        raise NotFound(str(exc)) from exc
    return LogChunkOut(
        **out, node=chunk.node, nodes=list(chunk.nodes), text=chunk.text, offset=chunk.offset
    )
