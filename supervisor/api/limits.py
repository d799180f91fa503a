"""A ceiling on request bodies, so one request cannot make the API buffer and parse megabytes.

Plain ASGI, inside the access log: a declared Content-Length over the limit is answered 413
before any of the body is read; a body that streams past the limit (chunked, or longer than
declared) stops being read at the limit, and the route's body read raises the 413, which the
error handlers render like every other error.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from supervisor.api.errors import error_response


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"request body exceeds {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await error_response(413, self._too_large())(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int | None:
    """The declared length; None when absent or unreadable (the stream count still applies)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
