"""What every command shares: one-line errors, the API client, spec loading.

Heavy modules (httpx, pydantic models) are imported inside functions so `nightwatch --help`
stays fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from supervisor.models import TERMINAL_RUN_STATES, RunState

if TYPE_CHECKING:
    import httpx

    from contracts.spec import RunSpec

DEFAULT_URL = "http://127.0.0.1:8787"
#: Every read command's `--json`: the document the table shows, for scripts (exit codes as is).
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print JSON (machine-readable) instead of the table.")
]
#: Run states after which no attempt runs (until an operator resumes one that needs attention).
FINAL_STATES = frozenset(s.value for s in (*TERMINAL_RUN_STATES, RunState.NEEDS_ATTENTION))


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def echo_json(document: Any, *, lines: bool = False) -> None:
    """One indented document, or (`lines`, for --follow) one compact document per line."""
    typer.echo(json.dumps(document) if lines else json.dumps(document, indent=2))


def load_spec(path: Path) -> RunSpec:
    """Parse a YAML/JSON spec file or exit with one line naming the bad fields."""
    import yaml
    from pydantic import ValidationError

    from contracts.spec import RunSpec

    try:
        return RunSpec.from_file(path)
    except OSError as exc:
        fail(f"{path}: {exc.strerror or exc}")
    except ValidationError as exc:
        parts = [
            f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg']}" for e in exc.errors()
        ]
        fail(f"{path}: " + "; ".join(parts))
    except (ValueError, yaml.YAMLError) as exc:  # YAML / JSON syntax, or not a mapping
        fail(f"{path}: {' '.join(str(exc).split())}")


class Api:
    """A thin httpx client for NIGHTWATCH_URL with NIGHTWATCH_TOKEN; errors exit in one line."""

    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        import httpx

        self.url = (url or os.environ.get("NIGHTWATCH_URL") or DEFAULT_URL).rstrip("/")
        token = token or os.environ.get("NIGHTWATCH_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=30.0)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        import httpx

        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            fail(f"cannot reach the supervisor at {self.url} ({type(exc).__name__}); "
                 "is `nightwatch serve` running and NIGHTWATCH_URL right?")  # fmt: skip
        if response.status_code >= 400:
            fail(_describe(response))
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()


def _describe(response: httpx.Response) -> str:
    try:
        body = response.json()
        message = body.get("message") or str(body)
    except ValueError:
        message = response.text.strip()[:200] or response.reason_phrase
    hint = " (set NIGHTWATCH_TOKEN)" if response.status_code == 401 else ""
    return f"HTTP {response.status_code}: {message}{hint}"


def local_settings() -> Any:
    from supervisor.settings import Settings

    return Settings.from_env()
