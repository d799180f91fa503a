"""Operator actions on a run: resume from needs_attention, roll back to a checkpoint.

Each only records the request (the run's owner or admin); the reconciler carries it out through
the same actuator as its own remedies, intent first and once (`supervisor.store.operator`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path
from pydantic import BaseModel, Field, model_validator

from supervisor import store
from supervisor.api.deps import SubmitToken, WriteSessionDep, authorize_run_write
from supervisor.api.schemas import RUN_ID_PATTERN, ErrorBody, RunOut
from supervisor.auth import RunWrite

router = APIRouter(prefix="/v1/runs", tags=["runs"])
RunId = Annotated[str, Path(pattern=RUN_ID_PATTERN, examples=["r-3f9a0c12d4e5"])]
RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Body is not decodable JSON"},
    401: {"model": ErrorBody, "description": "Missing or unknown token"},
    403: {"model": ErrorBody, "description": "Not the run's owner or admin"},
    404: {"model": ErrorBody, "description": "No such run"},
    409: {
        "model": ErrorBody,
        "description": "The run's state forbids it, a request is pending, "
        "or there is no complete checkpoint at that step",
    },
    422: {"model": ErrorBody, "description": "Invalid input; `problems` names the fields"},
}
MAX_STEP = 2**62


class ResumeIn(BaseModel):
    from_step: int | None = Field(
        default=None, ge=0, le=MAX_STEP,
        description="A complete checkpoint's step (0: from scratch); default the newest.",
    )  # fmt: skip


class RollbackIn(BaseModel):
    to_step: int = Field(ge=0, le=MAX_STEP, description="A complete checkpoint's step.")
    skip_samples: list[tuple[int, int]] = Field(
        default_factory=list, max_length=64,
        description="Global sample ranges [start, end) to skip from there on.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _ranges(self) -> RollbackIn:
        for start, end in self.skip_samples:
            if not 0 <= start < end <= MAX_STEP:
                raise ValueError(f"skip range [{start}, {end}) must have 0 <= start < end")
        return self


def _request(session: Any, caller: Any, run_id: str, write: RunWrite, **fields: Any) -> Any:
    authorize_run_write(session, caller, run_id, write)
    run = store.request_operator_action(session, run_id, by=caller.name, **fields)
    return RunOut.model_validate(run)


@router.post("/{run_id}/resume", response_model=RunOut, status_code=202, responses=RESPONSES)
def resume_run(
    run_id: RunId,
    session: WriteSessionDep,
    caller: SubmitToken,
    body: Annotated[ResumeIn | None, Body()] = None,
) -> Any:
    """Resume a run that needs attention: a new attempt from the newest checkpoint (or
    `from_step`), with its skips and exclusions; the recovery budget starts again."""
    from_step = body.from_step if body is not None else None
    return _request(session, caller, run_id, RunWrite.RESUME, kind="resume", to_step=from_step)


@router.post("/{run_id}/rollback", response_model=RunOut, status_code=202, responses=RESPONSES)
def rollback_run(
    run_id: RunId, session: WriteSessionDep, caller: SubmitToken, body: RollbackIn
) -> Any:
    """Stop the run's job and resume from checkpoint `to_step`, skipping `skip_samples`
    (a training run or one that needs attention)."""
    return _request(
        session, caller, run_id, RunWrite.ROLLBACK, kind="rollback", to_step=body.to_step,
        skip_ranges=[list(r) for r in body.skip_samples],
    )  # fmt: skip
