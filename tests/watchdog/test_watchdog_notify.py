"""Webhook notifications: retried until delivered, and never blocking the caller."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from supervisor.watchdog.notify import Notifier


class Hook:
    """A loopback webhook that fails the first `failures` posts, or hangs when `hang` is set."""

    def __init__(self, failures: int = 0, hang: float = 0.0) -> None:
        self.failures, self.hang = failures, hang
        self.received: list[dict] = []
        self.posts = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.posts += 1
                if hook.hang:
                    time.sleep(hook.hang)
                if hook.posts <= hook.failures:
                    self.send_response(503)
                else:
                    hook.received.append(json.loads(body))
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook(failures=2)
    yield h
    h.close()


def test_delivered_after_retries_with_slack_text(hook: Hook) -> None:
    n = Notifier(hook.url, attempts=4, backoff_s=0.01)
    assert n.send("[nightwatch] r1 NEEDS ATTENTION: restart storm", run_id="r1", remedy="escalate")
    assert n.flush(10)
    n.close()
    assert hook.posts == 3
    assert hook.received == [
        {
            "text": "[nightwatch] r1 NEEDS ATTENTION: restart storm",
            "run_id": "r1",
            "remedy": "escalate",
        }
    ]
    assert n.delivered == 1 and n.dropped == 0


def test_gives_up_and_never_blocks_the_caller() -> None:
    slow = Hook(failures=100, hang=0.3)
    try:
        n = Notifier(slow.url, attempts=2, backoff_s=0.01, timeout_s=2)
        started = time.perf_counter()
        for i in range(20):
            n.send(f"message {i}", run_id="r1")
        # Blocking would take ≥ 20 × 0.3 s; allow a loaded CI box its thread start-up.
        assert time.perf_counter() - started < 2.0
        n.close(timeout_s=0.1)
    finally:
        slow.close()


def test_disabled_without_url() -> None:
    assert Notifier(None).send("nothing") is False
