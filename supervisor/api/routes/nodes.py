"""Nodes: health as the supervisor knows it, and an operator's exclude / restore (admin).

A request is recorded with its evidence (intent) and answered 202; the reconciler carries it
out at its next tick and records the outcome (`supervisor.store.nodes`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path
from pydantic import BaseModel, Field

from supervisor import store
from supervisor.api.deps import ReadToken, SessionDep, WriteSessionDep, require
from supervisor.api.principals import Principal
from supervisor.api.schemas import NODE_PATTERN, ErrorBody, NodeDetail, NodeList
from supervisor.auth import Scope
from supervisor.models import NodeActionKind

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])
AdminToken = Annotated[Principal, Depends(require(Scope.ADMIN))]
NodeName = Annotated[str, Path(pattern=NODE_PATTERN, examples=["gpu017"])]
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or unknown token"},
    403: {"model": ErrorBody, "description": "Token lacks the scope"},
    404: {"model": ErrorBody, "description": "No node of that name is known"},
    422: {"model": ErrorBody, "description": "Invalid input; `problems` names the fields"},
}
WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    400: {"model": ErrorBody, "description": "Body is not decodable JSON"},
    409: {
        "model": ErrorBody,
        "description": "Already excluded (exclude), not excluded (restore), "
        "or another request on the node is pending",
    },
}


class NodeActionIn(BaseModel):
    reason: str = Field(default="", max_length=500, description="Why; kept as evidence.")


@router.get("", response_model=NodeList, responses=ERRORS)
def list_nodes(session: SessionDep, _: ReadToken) -> Any:
    """Every node Nightwatch has met (SLURM lists it, a job ran there, a run excludes it, a
    remedy struck it): health, strikes, exclusions, the incidents that indicted it, a pending
    request."""
    return {"items": store.list_nodes(session)}


@router.get("/{node}", response_model=NodeDetail, responses=ERRORS)
def get_node(node: NodeName, session: SessionDep, _: ReadToken) -> Any:
    """One node, with the operator requests made on it."""
    return store.get_node(session, node)


def _request(session: Any, caller: Principal, node: str, kind: NodeActionKind, body: Any) -> Any:
    reason = body.reason if body is not None else ""
    return store.request_node_action(session, node, kind, by=caller.name, reason=reason)


@router.post("/{node}/exclude", response_model=NodeDetail, status_code=202,
             responses=WRITE_ERRORS)  # fmt: skip
def exclude_node(
    node: NodeName,
    session: WriteSessionDep,
    caller: AdminToken,
    body: Annotated[NodeActionIn | None, Body()] = None,
) -> Any:
    """Take the node out of the fleet: from the reconciler's next tick, every run's next
    submission passes it to SLURM's `--exclude` (jobs running there go on)."""
    return _request(session, caller, node, NodeActionKind.EXCLUDE, body)


@router.post("/{node}/restore", response_model=NodeDetail, status_code=202,
             responses=WRITE_ERRORS)  # fmt: skip
def restore_node(
    node: NodeName,
    session: WriteSessionDep,
    caller: AdminToken,
    body: Annotated[NodeActionIn | None, Body()] = None,
) -> Any:
    """Put the node back: healthy, excluded neither by the fleet nor by the runs the watchdog
    excluded it from, and resumed in SLURM if Nightwatch drained it."""
    return _request(session, caller, node, NodeActionKind.RESTORE, body)
