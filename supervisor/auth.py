"""Token secrets and scopes: pure functions, no I/O.

A token is `nw_` + 256 random bits; the database keeps only its sha256, so a leaked database
does not leak usable tokens, and a plain hash is enough because the secret is high-entropy
(no password stretching needed). Scopes are ordered: admin ⊇ submit ⊇ read.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
from collections.abc import Iterable

TOKEN_PREFIX = "nw_"


class Scope(enum.StrEnum):
    READ = "read"
    SUBMIT = "submit"
    ADMIN = "admin"


_RANK = {Scope.READ: 0, Scope.SUBMIT: 1, Scope.ADMIN: 2}


def new_secret() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def allows(granted: Iterable[str], required: Scope) -> bool:
    """True when any granted scope is at least `required` (unknown scope names grant nothing)."""
    ranks = [_RANK[Scope(s)] for s in granted if s in Scope.__members__.values()]
    return any(rank >= _RANK[required] for rank in ranks)
