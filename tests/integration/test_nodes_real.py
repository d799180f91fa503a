"""Issue 25: an operator's node exclude / restore on the real stack. The supervisor knows
SLURM's nodes before any job ran there; a run submitted while two of the three are excluded
trains on the third; a restore lifts Nightwatch's own drain in SLURM and leaves anyone else's."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from .conftest import Stack, tiny_spec

pytestmark = pytest.mark.integration


def _until(what: str, check: Callable[[], Any], timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.5)
    return value


def _nodes(stack: Stack) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in stack.api("GET", "/v1/nodes")["items"]}


def _settled(stack: Stack, *names: str) -> Callable[[], dict[str, dict[str, Any]] | None]:
    def check() -> dict[str, dict[str, Any]] | None:
        nodes = _nodes(stack)
        return nodes if all(nodes[n]["pending"] is None for n in names) else None

    return check


@pytest.mark.timeout(300)
def test_excluded_nodes_are_avoided_and_a_restore_lifts_only_nightwatchs_drain(
    stack: Stack,
) -> None:
    _until("SLURM's nodes listed", lambda: {"n1", "n2", "n3"} <= set(_nodes(stack)))
    try:
        for node in ("n1", "n2"):
            stack.api("POST", f"/v1/nodes/{node}/exclude", {"reason": "integration test"})
        nodes = _until("exclusions applied", _settled(stack, "n1", "n2"))
        assert nodes["n1"]["excluded"] and nodes["n2"]["excluded"] and not nodes["n3"]["excluded"]
        spec = tiny_spec(
            "it-node-exclude", stack.data,
            parallelism={"data": 1}, resources={"nodes": 1},
            training={"train_steps": 10, "global_batch_size": 2},
        )  # fmt: skip
        run = stack.wait_run(stack.api("POST", "/v1/runs", spec)["id"], timeout_s=180)
        assert run["state"] == "succeeded", run
        (attempt,) = run["attempts"]
        assert attempt["nodes"] == ["n3"] and {"n1", "n2"} <= set(attempt["exclude"])

        stack.slurm.drain("n1", "nightwatch: hang on n1")
        stack.slurm.drain("n2", "admin: fan replaced")
        for node in ("n1", "n2"):
            stack.api("POST", f"/v1/nodes/{node}/restore", {"reason": "fixed"})
        nodes = _until("restores applied", _settled(stack, "n1", "n2"))
        assert not nodes["n1"]["excluded"] and nodes["n1"]["health"] == "healthy"
        detail = stack.api("GET", "/v1/nodes/n1")
        assert detail["actions"][0]["result"]["undrained"] is True
        slurm = stack.slurm.nodes()
        assert not slurm["n1"].drained and slurm["n2"].drained  # someone else's drain stays
    finally:
        for node in ("n1", "n2"):
            if stack.slurm.nodes()[node].drained:
                stack.slurm.resume_node(node)
            if _nodes(stack)[node]["excluded"]:
                stack.api("POST", f"/v1/nodes/{node}/restore", {"reason": "cleanup"})
        _until("cleanup applied", _settled(stack, "n1", "n2"))
