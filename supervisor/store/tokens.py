"""API tokens: created with their secret shown once, looked up by its hash, revoked."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from supervisor.auth import Scope, hash_secret, new_secret
from supervisor.models import (
    Token,
)
from supervisor.store.errors import NotFound


def create_token(
    session: Session,
    name: str,
    scopes: Iterable[Scope],
    run_id: str | None = None,
    owner: str | None = None,
) -> tuple[Token, str]:
    """Create a token and return it with its secret, which is never stored or shown again.

    `owner`: the principal its runs belong to (a person or team; default: the name)."""
    secret = new_secret()
    token = Token(
        id=f"t-{secrets.token_hex(6)}",
        name=name,
        owner=owner or name,
        scopes=sorted({Scope(s).value for s in scopes}),
        hash=hash_secret(secret),
        run_id=run_id,
    )
    session.add(token)
    session.commit()
    return token, secret


def token_for_secret(session: Session, secret: str) -> Token | None:
    """The live token with this secret, or None (unknown or revoked)."""
    token = session.scalar(select(Token).where(Token.hash == hash_secret(secret)))
    return None if token is None or token.revoked else token


def list_tokens(session: Session) -> Sequence[Token]:
    """Every token, oldest first (secrets are never stored, so none can be shown)."""
    return session.scalars(select(Token).order_by(Token.created_at, Token.id)).all()


def revoke_token(session: Session, name_or_id: str) -> list[Token]:
    """Revoke the token with this id, else every live token with this name; returns them.

    Idempotent: a token already revoked is found by its id and stays revoked."""
    tokens = session.scalars(select(Token).where(Token.id == name_or_id)).all() or (
        session.scalars(
            select(Token).where(Token.name == name_or_id, Token.revoked.is_(False))
        ).all()
    )
    if not tokens:
        session.rollback()
        raise NotFound(f"no token named {name_or_id!r} or with that id")
    for token in tokens:
        token.revoked = True
    session.commit()
    return list(tokens)


def revoke_run_tokens(session: Session, run_id: str) -> None:
    """A run that ended needs no worker: its per-run tokens stop working (in the caller's
    transaction, so the run is never terminal while its tokens live)."""
    session.execute(
        update(Token).where(Token.run_id == run_id, Token.revoked.is_(False)).values(revoked=True)
    )
