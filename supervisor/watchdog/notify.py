"""Webhook notifications (generic JSON with a Slack-compatible `text` field).

Why a queue and a thread: a slow or dead webhook must never delay the reconcile tick, so
`send` only enqueues; one background thread posts with tenacity retries and drops (with a log
line) what it cannot deliver. A full queue drops the newest message rather than blocking.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

log = logging.getLogger("nightwatch.notify")


class Notifier:
    def __init__(
        self,
        url: str | None,
        *,
        attempts: int = 5,
        timeout_s: float = 5.0,
        max_queue: int = 1000,
        backoff_s: float = 0.5,
    ) -> None:
        self.url = url
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.delivered = 0
        self.dropped = 0
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(max_queue)
        self._client = httpx.Client(timeout=timeout_s)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def send(self, text: str, **fields: Any) -> bool:
        """Enqueue a message; returns at once (False when disabled or the queue is full)."""
        if not self.url:
            return False
        self._ensure_thread()
        try:
            self._queue.put_nowait({"text": text, **fields})
        except queue.Full:
            self.dropped += 1
            log.warning("notification queue full; dropped", extra={"run_id": fields.get("run_id")})
            return False
        return True

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="notify", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            message = self._queue.get()
            try:
                if message is None:
                    return
                self._post(message)
            finally:
                self._queue.task_done()

    def _post(self, message: dict[str, Any]) -> None:
        assert self.url is not None
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(self.attempts),
                wait=wait_exponential(multiplier=self.backoff_s, max=30),
                retry=retry_if_exception_type(httpx.HTTPError),
                reraise=True,
            ):
                with attempt:
                    self._client.post(self.url, json=message).raise_for_status()
            self.delivered += 1
        except httpx.HTTPError as exc:
            self.dropped += 1
            log.warning(
                f"webhook failed after {self.attempts} attempts: {exc}",
                extra={"run_id": message.get("run_id")},
            )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the queue is empty (tests, shutdown); True when it drained in time."""
        done = threading.Event()

        def waiter() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout_s)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return  # still posting: the daemon thread keeps its client until it ends
        self._client.close()
