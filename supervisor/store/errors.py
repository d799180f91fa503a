"""What the store raises: a missing row, a conflicting request."""

from __future__ import annotations


class StoreError(Exception):
    """Base for errors the API maps to 4xx responses."""


class NotFound(StoreError):
    pass


class Conflict(StoreError):
    pass


class IdempotencyConflict(Conflict):
    pass


class CheckpointDirInUse(Conflict):
    pass
