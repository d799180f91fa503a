"""Who is calling: a token resolved to a Principal, with a short-lived cache.

Every API call is authenticated, so the token lookup is on the hot path; caching resolved
tokens for `ttl` seconds saves a query and a threadpool hop per request. The price is that a
revoked token keeps working for at most `ttl` seconds (Settings.token_cache_seconds; 0 turns
the cache off). Unknown tokens are never cached, so garbage cannot grow the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy.orm import Session

from supervisor import store

MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class Principal:
    token_id: str
    name: str
    owner: str
    scopes: tuple[str, ...]
    run_id: str | None


class PrincipalCache:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._entries: dict[str, tuple[float, Principal]] = {}

    def get(self, secret: str) -> Principal | None:
        entry = self._entries.get(secret)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, secret: str, principal: Principal) -> None:
        if self.ttl <= 0:
            return
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
        self._entries[secret] = (time.monotonic() + self.ttl, principal)


def resolve(session: Session, secret: str) -> Principal | None:
    token = store.token_for_secret(session, secret)
    if token is None:
        return None
    return Principal(token.id, token.name, token.owner, tuple(token.scopes), token.run_id)
