"""What a caller may submit beyond a valid spec: privileged sections and confined paths.

Both need the server's view (the caller's scopes, the operator's settings), so they live here
and not in the spec model, which stays pure. A spec that injects faults or drains nodes can
disturb other teams' jobs and SLURM nodes: it needs the `admin` scope unless the operator
allowed it for everyone (`allow_fault_injection`, `allow_node_drain`; off by default).
"""

from __future__ import annotations

import asyncio

from fastapi import HTTPException

from contracts.spec import RunSpec
from supervisor.api.errors import SpecRejected
from supervisor.api.principals import Principal
from supervisor.auth import Scope, allows
from supervisor.layout import Problem
from supervisor.roots import confine
from supervisor.settings import Settings


def privileged_fields(spec: RunSpec, settings: Settings) -> list[str]:
    """The spec's sections that need `admin` on this server."""
    fields = []
    if spec.faults and not settings.allow_fault_injection:
        fields.append("faults")
    if spec.recovery.drain_excluded_nodes and not settings.allow_node_drain:
        fields.append("recovery.drain_excluded_nodes")
    return fields


def has_paths(spec: RunSpec) -> bool:
    data = spec.data
    return data.blend is not None or any(
        p is not None for p in (spec.checkpoint.dir, data.prefix, data.tokenizer)
    )


async def path_problems(spec: RunSpec, settings: Settings) -> tuple[RunSpec, list[Problem]]:
    """`supervisor.roots.confine` off the event loop (it asks the filesystem)."""
    if not has_paths(spec):
        return spec, []
    return await asyncio.to_thread(confine, spec, settings)


async def admit(spec: RunSpec, caller: Principal, settings: Settings) -> RunSpec:
    """The spec to store (paths resolved), or 403 / 422 naming what the caller may not ask."""
    if (fields := privileged_fields(spec, settings)) and not allows(caller.scopes, Scope.ADMIN):
        raise HTTPException(
            403, f"{' and '.join(fields)} need the admin scope (token {caller.name!r} lacks it)"
        )
    spec, problems = await path_problems(spec, settings)
    if problems:
        raise SpecRejected(problems)
    return spec
