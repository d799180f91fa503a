"""Webhook notifications (generic JSON with a Slack-compatible `text` field), at least once.

Messages are rows of the outbox (supervisor.watchdog.outbox), written by the actuator in the
transaction of what they announce, so a supervisor killed right after an escalation still
sends it: whichever process runs next delivers what is due. Why a thread: a slow or dead
webhook must never delay the reconcile tick. Each due message gets a few quick tries (tenacity)
and then waits, backing off up to `outbox.MAX_BACKOFF_S`, and is tried again until delivered.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from supervisor.db import Database
from supervisor.models import OutboxMessage, utcnow
from supervisor.watchdog import outbox

log = logging.getLogger("nightwatch.notify")


class Notifier:
    def __init__(
        self,
        url: str | None,
        db: Database | None = None,
        *,
        attempts: int = 3,
        timeout_s: float = 5.0,
        backoff_s: float = 0.5,
        poll_s: float = 5.0,
        batch: int = 50,
    ) -> None:
        self.url = url
        self.db = db
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.poll_s = poll_s
        self.batch = batch
        self.delivered = 0
        self.failed_tries = 0
        self._client = httpx.Client(timeout=timeout_s)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Messages are stored only when they can be sent (no webhook: nothing to keep)."""
        return bool(self.url) and self.db is not None

    def enqueue(self, session: Any, key: str, text: str, **fields: Any) -> None:
        """Add a message to the caller's transaction, if enabled; `wake()` after the commit."""
        if self.enabled:
            outbox.enqueue(session, key, text, **fields)

    def wake(self) -> None:
        """Deliver what is due now (the sender also looks every `poll_s`)."""
        if not self.enabled:
            return
        self._ensure_thread()
        self._idle.clear()
        self._wake.set()

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="notify", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                sent = self.deliver_due()
            except Exception:  # the database or a bug: try again at the next wake or poll
                log.exception("outbox delivery failed")
                sent = 0
            if sent == 0:
                self._idle.set()
                self._wake.wait(self.poll_s)

    def deliver_due(self) -> int:
        """Post the due messages once each (with a few quick retries); how many were posted."""
        assert self.db is not None and self.url is not None
        hold = timedelta(seconds=self.timeout_s * (self.attempts + 1) + 30)
        with self.db.write_session() as s:
            due = outbox.claim_due(s, self.batch, hold)
        for message in due:
            self._deliver(message)
        return len(due)

    def _deliver(self, message: OutboxMessage) -> None:
        assert self.db is not None and self.url is not None
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(self.attempts),
                wait=wait_exponential(multiplier=self.backoff_s, max=30),
                retry=retry_if_exception_type(httpx.HTTPError),
                reraise=True,
            ):
                with attempt:
                    self._client.post(self.url, json=message.payload_json).raise_for_status()
        except httpx.HTTPError as exc:
            self.failed_tries += 1
            retry_at = utcnow() + timedelta(
                seconds=outbox.backoff_s(message.tries + 1, self.backoff_s)
            )
            with self.db.write_session() as s:
                outbox.mark_failed(s, message.id, str(exc), retry_at)
            log.warning(
                f"webhook failed, retrying at {retry_at:%H:%M:%S}: {exc}",
                extra={"run_id": message.run_id},
            )
            return
        with self.db.write_session() as s:
            outbox.mark_delivered(s, message.id)
        self.delivered += 1

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the sender found nothing due (tests, shutdown); True when in time."""
        if not self.enabled:
            return True
        self.wake()
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return  # still posting: the daemon thread keeps its client until it ends
        self._client.close()
