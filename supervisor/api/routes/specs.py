"""Layout report without submitting: what would this spec cost per GPU, and can it run?"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Request

from supervisor.api.deps import ReadToken
from supervisor.api.examples import SPEC_EXAMPLES
from supervisor.api.routes.runs import ERRORS
from supervisor.api.schemas import LayoutOut
from supervisor.layout import layout_report
from supervisor.roots import confine
from supervisor.spec import RunSpec

router = APIRouter(prefix="/v1/specs", tags=["specs"], responses=ERRORS)


@router.post("/validate", response_model=LayoutOut)
def validate_spec(
    spec: Annotated[RunSpec, Body(openapi_examples=SPEC_EXAMPLES)], request: Request, _: ReadToken
) -> Any:
    """Always 200 for a well-formed spec: `ok` says whether it can run, `problems` why not
    (a path outside this server's roots among them)."""
    spec, path_problems = confine(spec, request.app.state.settings)
    report = layout_report(spec)
    report.problems.extend(path_problems)
    return report.as_dict()
