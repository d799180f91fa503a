"""Typed dependencies: database sessions and bearer-token auth with scopes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from supervisor import store
from supervisor.auth import Scope, allows
from supervisor.db import Database
from supervisor.models import Token


def get_database(request: Request) -> Database:
    return request.app.state.db


DatabaseDep = Annotated[Database, Depends(get_database)]


# The session dependencies are async on purpose: FastAPI runs the teardown of a *sync*
# generator dependency in the threadpool, so when every pool thread is blocked waiting for the
# SQLite write lock (or a pooled connection), the request holding it can never release it.
# An async teardown runs on the event loop; closing a session is a quick rollback.
async def get_session(db: DatabaseDep) -> AsyncIterator[Session]:
    session = db.session()
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


def _authenticate(
    db: DatabaseDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Token:
    """Look the token up in its own short session: holding a second pooled connection per
    request while the route waits for the first would let concurrent requests deadlock."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(401, "missing bearer token", headers=_CHALLENGE)
    with db.session() as session:
        token = store.token_for_secret(session, credentials.credentials)
    if token is None:
        raise HTTPException(401, "unknown or revoked token", headers=_CHALLENGE)
    return token


def require(scope: Scope) -> Callable[..., Token]:
    """Dependency: the caller's token, which must grant `scope` (admin ⊇ submit ⊇ read)."""

    def check(token: Annotated[Token, Depends(_authenticate)]) -> Token:
        if not allows(token.scopes, scope):
            raise HTTPException(403, f"token {token.name!r} lacks scope {scope.value!r}")
        return token

    return check


ReadToken = Annotated[Token, Depends(require(Scope.READ))]
SubmitToken = Annotated[Token, Depends(require(Scope.SUBMIT))]
