"""Token secrets, scopes and who may write to a run: pure functions, no I/O.

A token is `nw_` + 256 random bits; the database keeps only its sha256, so a leaked database
does not leak usable tokens, and a plain hash is enough because the secret is high-entropy
(no password stretching needed). Scopes are ordered: admin ⊇ submit ⊇ read.

Runs belong to the owner of the token that submitted them. Reads are fleet-wide; a write to a
run needs its owner (with `submit`) or `admin`. A per-run worker token (one the supervisor
hands a job) may do only what the worker does, to its own run.
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


class RunWrite(enum.StrEnum):
    """The writes on an existing run."""

    CANCEL = "cancel"
    RESUME = "resume"
    ROLLBACK = "roll back"
    REGISTER_ENDPOINT = "register endpoints"


#: What a worker token may do to its own run: what `worker.registration` calls, nothing more.
WORKER_WRITES = frozenset({RunWrite.REGISTER_ENDPOINT})


def run_write_refusal(
    write: RunWrite,
    *,
    scopes: Iterable[str],
    owner: str,
    token_run_id: str | None,
    run_id: str,
    run_owner: str,
) -> str | None:
    """Why the caller may not make `write` to the run, or None when it may.

    `scopes`, `owner`, `token_run_id`: the caller's token; `run_owner`: the run's owner."""
    if token_run_id is not None:
        if token_run_id != run_id:
            return "a worker token may write only to its own run"
        if write not in WORKER_WRITES:
            return f"a worker token may not {write.value}"
        return None
    if allows(scopes, Scope.ADMIN):
        return None
    if not allows(scopes, Scope.SUBMIT):
        return f"{write.value} needs scope 'submit'"
    if owner != run_owner:
        return f"run {run_id} belongs to another owner; {write.value} needs its owner or admin"
    return None


def allows(granted: Iterable[str], required: Scope) -> bool:
    """True when any granted scope is at least `required` (unknown scope names grant nothing)."""
    ranks = [_RANK[Scope(s)] for s in granted if s in Scope.__members__.values()]
    return any(rank >= _RANK[required] for rank in ranks)
