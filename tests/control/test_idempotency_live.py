"""A CI client retrying POST /v1/runs 50 times at once with one Idempotency-Key creates exactly
one run, against a real uvicorn server on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from supervisor import store
from supervisor.api.examples import TINY_SPEC
from supervisor.db import Database

RETRIES = 50


async def _burst(url: str, headers: dict[str, str], bodies: list[dict[str, Any]]) -> list[Any]:
    limits = httpx.Limits(max_connections=RETRIES)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        start = asyncio.Event()

        async def one(body: dict[str, Any]) -> httpx.Response:
            await start.wait()
            return await client.post("/v1/runs", json=body, headers=headers)

        tasks = [asyncio.create_task(one(b)) for b in bodies]
        await asyncio.sleep(0.2)  # let every task reach the gate
        start.set()
        return await asyncio.gather(*tasks)


def test_50_concurrent_retries_create_exactly_one_run(
    live_server: Any, tokens: Any, database: Database
) -> None:
    headers = {**tokens.headers(), "Idempotency-Key": "ci-build-4711"}
    responses = asyncio.run(_burst(live_server.url, headers, [TINY_SPEC] * RETRIES))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * (RETRIES - 1) + [201], codes
    assert len({r.json()["id"] for r in responses}) == 1
    with database.session() as s:
        assert store.list_runs(s).total == 1


def test_concurrent_reuse_with_other_bodies_conflicts(
    live_server: Any, tokens: Any, database: Database
) -> None:
    headers = {**tokens.headers(), "Idempotency-Key": "shared-key"}
    bodies = [{**TINY_SPEC, "name": f"variant-{i % 2}"} for i in range(20)]
    responses = asyncio.run(_burst(live_server.url, headers, bodies))
    winners = [r for r in responses if r.status_code in (200, 201)]
    losers = [r for r in responses if r.status_code == 409]
    assert len(winners) + len(losers) == len(bodies)
    assert len({r.json()["id"] for r in winners}) == 1
    winning_name = winners[0].json()["name"]
    assert all(r.json()["name"] == winning_name for r in winners)
    assert len(losers) == 10  # exactly the other variant
    with database.session() as s:
        assert store.list_runs(s).total == 1
