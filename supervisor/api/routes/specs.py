"""Layout report without submitting: what would this spec cost per GPU, and can it run?"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, HTTPException, Query, Request

from contracts.spec import RunSpec
from supervisor.api.deps import ReadToken
from supervisor.api.examples import SPEC_EXAMPLES
from supervisor.api.principals import Principal
from supervisor.api.routes.runs import ERRORS
from supervisor.api.schemas import ErrorBody, LayoutOut
from supervisor.auth import Scope, allows
from supervisor.layout import layout_report
from supervisor.preview import sbatch_preview
from supervisor.roots import confine
from supervisor.settings import Settings

router = APIRouter(prefix="/v1/specs", tags=["specs"], responses=ERRORS)

SMOKE_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {
        "model": ErrorBody,
        "description": "`smoke`: off on this server (use the CLI), or the token is not admin",
    },
    409: {"model": ErrorBody, "description": "`smoke`: another smoke check is running"},
}


@router.post("/validate", response_model=LayoutOut, responses=SMOKE_ERRORS)
def validate_spec(
    spec: Annotated[RunSpec, Body(openapi_examples=SPEC_EXAMPLES)],
    request: Request,
    caller: ReadToken,
    render: Annotated[
        Literal["sbatch"] | None,
        Query(description="`sbatch`: also show what the first attempt would submit."),
    ] = None,
    smoke: Annotated[
        bool,
        Query(
            description="Also train the spec's features at a tiny size on this server's host "
            "(admin tokens, where NIGHTWATCH_ALLOW_SMOKE_CHECKS is on; one at a time; "
            "NIGHTWATCH_SMOKE_TIMEOUT_SECONDS). Elsewhere: `nightwatch validate SPEC --smoke`."
        ),
    ] = False,
) -> Any:
    """Always 200 for a well-formed spec: `ok` says whether it can run, `problems` why not
    (a path outside this server's roots among them); with `smoke`, `smoke.ok` whether it
    trained. A sync route, so a smoke check waits in a worker thread, never on the event loop."""
    settings = request.app.state.settings
    if smoke:
        _check_smoke_allowed(settings, caller)
    spec, path_problems = confine(spec, settings)
    report = layout_report(spec)
    report.problems.extend(path_problems)
    body = report.as_dict()
    if render == "sbatch":
        body["sbatch"] = sbatch_preview(spec, settings)
    if smoke and body["ok"]:
        body["smoke"] = _smoke(spec, settings)
    return body


def _check_smoke_allowed(settings: Settings, caller: Principal) -> None:
    """403 as for the other operator switches (`allow_fault_injection`): the server can, but
    its operator has not let tokens make it train (the CLI can, on the caller's machine)."""
    if not settings.allow_smoke_checks:
        raise HTTPException(
            403,
            "smoke checks are off on this server (NIGHTWATCH_ALLOW_SMOKE_CHECKS): they train on "
            "its host; run `nightwatch validate SPEC --smoke` where the training dependencies are",
        )
    if not allows(caller.scopes, Scope.ADMIN):
        raise HTTPException(403, f"token {caller.name!r}: a smoke check needs scope 'admin'")


def _smoke(spec: RunSpec, settings: Settings) -> dict[str, Any]:
    """One smoke check at a time per host (a file lock under home, so across the API's
    worker processes too), bounded by smoke_timeout_seconds; no logs are left behind."""
    from supervisor.smoke.plan import shrink
    from supervisor.smoke.run import SmokeBusy, local_gpus, one_at_a_time, run_smoke

    try:
        with one_at_a_time(settings.home / "smoke.lock"):
            plan = shrink(spec, gpus=local_gpus())
            result = run_smoke(
                plan,
                timeout_s=settings.smoke_timeout_seconds,
                keep_failed_logs=False,
                home=settings.home,
            )
    except SmokeBusy as exc:
        raise HTTPException(409, str(exc), headers={"Retry-After": "30"}) from exc
    return result.as_dict() | {"spec": plan.spec.model_dump(mode="json")}
