"""Layout report without submitting: what would this spec cost per GPU, and can it run?"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query, Request

from contracts.spec import RunSpec
from supervisor.api.deps import ReadToken
from supervisor.api.examples import SPEC_EXAMPLES
from supervisor.api.routes.runs import ERRORS
from supervisor.api.schemas import LayoutOut
from supervisor.layout import layout_report
from supervisor.preview import sbatch_preview
from supervisor.roots import confine

router = APIRouter(prefix="/v1/specs", tags=["specs"], responses=ERRORS)


@router.post("/validate", response_model=LayoutOut)
def validate_spec(
    spec: Annotated[RunSpec, Body(openapi_examples=SPEC_EXAMPLES)],
    request: Request,
    _: ReadToken,
    render: Annotated[
        Literal["sbatch"] | None,
        Query(description="`sbatch`: also show what the first attempt would submit."),
    ] = None,
) -> Any:
    """Always 200 for a well-formed spec: `ok` says whether it can run, `problems` why not
    (a path outside this server's roots among them)."""
    settings = request.app.state.settings
    spec, path_problems = confine(spec, settings)
    report = layout_report(spec)
    report.problems.extend(path_problems)
    body = report.as_dict()
    if render == "sbatch":
        body["sbatch"] = sbatch_preview(spec, settings)
    return body
