"""Every error is JSON `{error, message, problems}`; nothing leaks a traceback.

Handlers are async so they run on the event loop: a sync handler needs a threadpool thread,
and those may all be waiting for a lock that the failing request still holds.

Validation errors name the field (dotted, without the `body.` prefix) so a CI log reads like
`parallelism.tensor: …`; layout problems carry their numbers in the message.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from supervisor.layout import Problem
from supervisor.store import Conflict, IdempotencyConflict, NotFound

log = logging.getLogger("nightwatch.api")

_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
          405: "method_not_allowed", 409: "conflict", 413: "content_too_large",
          415: "unsupported_media_type",
          422: "invalid", 503: "unavailable"}  # fmt: skip


class LayoutRejected(Exception):
    """The spec parses but its layout cannot run."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__("; ".join(f"{p.field}: {p.message}" for p in problems))
        self.problems = list(problems)


class SpecRejected(LayoutRejected):
    """The spec parses but asks for something this server does not allow (a path outside
    the operator's roots)."""


def error_response(
    status: int,
    message: str,
    problems: list[dict[str, str]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": _CODES.get(status, "error"), "message": message, "problems": problems or []}
    return JSONResponse(body, status_code=status, headers=headers)


def _field(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in {"body", "query", "path", "header"}:
        parts = parts[1:] if parts[0] == "body" else parts
    return ".".join(parts) or "body"


async def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    if undecodable := [e for e in exc.errors() if e.get("type") == "json_invalid"]:
        error = (undecodable[0].get("ctx") or {}).get("error", "decode error")
        position = _field(undecodable[0].get("loc", ()))  # ("body", character offset)
        return error_response(400, f"body is not valid JSON: {error} (character {position})")
    problems = [
        {"field": _field(e.get("loc", ())), "message": str(e.get("msg", "invalid")),
         "severity": "error"}
        for e in exc.errors()
    ]  # fmt: skip
    summary = "; ".join(f"{p['field']}: {p['message']}" for p in problems[:5])
    return error_response(422, f"invalid request: {summary}", problems)


async def _layout(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LayoutRejected)
    problems = [
        {"field": p.field, "message": p.message, "severity": p.severity} for p in exc.problems
    ]
    return error_response(422, f"layout cannot run: {exc}", problems)


async def _spec(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SpecRejected)
    problems = [
        {"field": p.field, "message": p.message, "severity": p.severity} for p in exc.problems
    ]
    return error_response(422, f"invalid request: {exc}", problems)


async def _http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail), headers=exc.headers)


async def _not_found(_: Request, exc: Exception) -> JSONResponse:
    return error_response(404, str(exc))


async def _conflict(_: Request, exc: Exception) -> JSONResponse:
    return error_response(409, str(exc))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc, extra={"path": request.url.path})
    return error_response(500, "internal error; see the supervisor log")


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(SpecRejected, _spec)
    app.add_exception_handler(LayoutRejected, _layout)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(NotFound, _not_found)
    app.add_exception_handler(IdempotencyConflict, _conflict)
    app.add_exception_handler(Conflict, _conflict)
    app.add_exception_handler(Exception, _unexpected)
