"""Schemathesis against the live /openapi.json of a real uvicorn server, authorized: no server
errors, and every response matches the documented status codes, content types, headers and
schemas. Bounded by example count so it stays well under a minute."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.db import Database

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
    ]
)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"], indirect=True)
def test_api_conforms_to_its_schema(
    live_server: Any, tokens: Any, database: Database, tmp_path: Path
) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st, "schemathesis CLI not installed"
    command = [
        st, "run", f"{live_server.url}/openapi.json",
        "--checks", CHECKS,
        "--header", f"Authorization: Bearer {tokens.admin}",
        "--max-examples", "40",
        "--phases", "examples,fuzzing",
        "--generation-database", "none",
        "--workers", "2",
        "--seed", "1",
        "--request-timeout", "60",
        "--suppress-health-check", "all",
        "--no-color",
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "No issues found" in output or "passed" in output, output[-3000:]
