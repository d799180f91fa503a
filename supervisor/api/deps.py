"""Typed dependencies: database sessions and bearer-token auth with scopes.

Dependencies that do no I/O are async: FastAPI runs every sync dependency in the threadpool,
and each hop costs more than the work on a busy 2-core machine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from supervisor import store
from supervisor.api.principals import Principal, PrincipalCache, resolve
from supervisor.auth import RunWrite, Scope, allows, run_write_refusal
from supervisor.db import Database


async def get_database(request: Request) -> Database:
    return request.app.state.db


DatabaseDep = Annotated[Database, Depends(get_database)]


# The session dependencies are async on purpose: FastAPI runs the teardown of a *sync*
# generator dependency in the threadpool, so when every pool thread is blocked waiting for the
# SQLite write lock (or a pooled connection), the request holding it can never release it.
# An async teardown runs on the event loop; closing a session is a quick rollback.
async def get_session(db: DatabaseDep) -> AsyncIterator[Session]:
    session = db.request_read_session()
    try:
        yield session
    finally:
        session.close()


async def get_write_session(db: DatabaseDep) -> AsyncIterator[Session]:
    session = db.write_session()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]
WriteSessionDep = Annotated[Session, Depends(get_write_session)]

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer nw_…`")
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


async def _authenticate(
    request: Request,
    db: DatabaseDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """Resolve the bearer token (cached; on a miss, looked up in its own short session in the
    threadpool, never holding a second pooled connection while the route waits for one)."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(401, "missing bearer token", headers=_CHALLENGE)
    secret = credentials.credentials
    cache: PrincipalCache = request.app.state.principals
    principal = cache.get(secret)
    if principal is None:
        principal = await run_in_threadpool(_lookup, db, secret)
        if principal is None:
            raise HTTPException(401, "unknown or revoked token", headers=_CHALLENGE)
        cache.put(secret, principal)
    return principal


def _lookup(db: Database, secret: str) -> Principal | None:
    with db.session() as session:
        return resolve(session, secret)


def require(scope: Scope) -> Callable[..., Awaitable[Principal]]:
    """Dependency: the caller, whose token must grant `scope` (admin ⊇ submit ⊇ read)."""

    async def check(principal: Annotated[Principal, Depends(_authenticate)]) -> Principal:
        if not allows(principal.scopes, scope):
            raise HTTPException(403, f"token {principal.name!r} lacks scope {scope.value!r}")
        return principal

    return check


ReadToken = Annotated[Principal, Depends(require(Scope.READ))]
SubmitToken = Annotated[Principal, Depends(require(Scope.SUBMIT))]


def authorize_run_write(session: Session, caller: Principal, run_id: str, write: RunWrite) -> None:
    """403 unless the caller may make `write` to the run (404 when there is no such run).

    Reads the run through `session`, so in a write session the check and the write see the
    same row; a later `store.get_run` of it is answered from the session, not the database."""
    run = store.get_run(session, run_id)
    refusal = run_write_refusal(
        write,
        scopes=caller.scopes,
        owner=caller.owner,
        token_run_id=caller.run_id,
        run_id=run_id,
        run_owner=run.owner,
    )
    if refusal is not None:
        session.rollback()
        raise HTTPException(403, f"token {caller.name!r}: {refusal}")
