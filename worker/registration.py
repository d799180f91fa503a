"""Register this node's metrics endpoint with the supervisor and keep it fresh.

Why never raise, nor wait: the supervisor being down or slow must not cost training steps.
The first PUT goes out from the heartbeat's daemon thread as training starts (the endpoint
serves already; Prometheus finds it at its next discovery), retried briefly (tenacity) and
then left to the heartbeat, which re-sends the same PUT every `interval_s`; every failure is
logged, none propagates.
"""

from __future__ import annotations

import logging
import threading

import httpx
from tenacity import retry, stop_after_attempt, wait_exponential

log = logging.getLogger("nightwatch.worker")

HEARTBEAT_S = 10.0


class Registrar:
    def __init__(
        self,
        url: str,
        token: str | None,
        run_id: str,
        attempt: int,
        node: str,
        interval_s: float = HEARTBEAT_S,
        timeout_s: float = 3.0,
    ) -> None:
        self.endpoint = f"{url.rstrip('/')}/v1/runs/{run_id}/attempts/{attempt}/endpoints/{node}"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.context = {"run_id": run_id, "attempt": attempt}
        self._body: dict[str, object] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @retry(stop=stop_after_attempt(3), wait=wait_exponential(multiplier=0.2, max=2), reraise=True)
    def _put(self) -> None:
        response = httpx.put(
            self.endpoint, json=self._body, headers=self.headers, timeout=self.timeout_s
        )
        response.raise_for_status()

    def beat(self) -> bool:
        """One registration/heartbeat; False (logged) when the supervisor did not take it."""
        try:
            self._put()
        except (httpx.HTTPError, OSError) as exc:
            log.warning("endpoint registration failed: %s", exc, extra=self.context)
            return False
        return True

    def start(self, host: str, port: int) -> None:
        """Register at once and keep heartbeating until `stop()` or process exit, from a
        daemon thread: the caller goes on training while the PUT is in flight."""
        self._body = {"host": host, "port": port}
        self._thread = threading.Thread(target=self._loop, name="nightwatch-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        self.beat()
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self) -> None:
        self._stop.set()
