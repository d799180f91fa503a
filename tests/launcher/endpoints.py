"""A loopback stand-in for the supervisor's two worker-facing routes (docs/contracts.md).

`PUT /v1/runs/{run}/attempts/{n}/endpoints/{node}` records an endpoint and
`GET /v1/prometheus/targets` serves them as Prometheus HTTP-SD JSON, with the bearer tokens the
contract asks for. It lets the launcher tests check the worker's registration and Prometheus
discovery without the control plane's database.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PUT_PATH = re.compile(r"^/v1/runs/([^/]+)/attempts/(\d+)/endpoints/([^/]+)$")


class EndpointRegistry:
    def __init__(self, worker_token: str, read_token: str) -> None:
        self.worker_token = worker_token
        self.read_token = read_token
        self.endpoints: dict[tuple[str, int, str], dict[str, object]] = {}
        self.puts = 0
        self.lock = threading.Lock()
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _authorized(self, token: str) -> bool:
                if self.headers.get("Authorization") == f"Bearer {token}":
                    return True
                self.send_response(401)
                self.end_headers()
                return False

            def do_PUT(self) -> None:
                m = PUT_PATH.match(self.path)
                if not m:
                    self.send_response(404)
                    self.end_headers()
                    return
                if not self._authorized(registry.worker_token):
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with registry.lock:
                    registry.endpoints[(m[1], int(m[2]), m[3])] = body
                    registry.puts += 1
                self.send_response(204)
                self.end_headers()

            def do_GET(self) -> None:
                if self.path != "/v1/prometheus/targets":
                    self.send_response(404)
                    self.end_headers()
                    return
                if not self._authorized(registry.read_token):
                    return
                with registry.lock:
                    groups = [
                        {
                            "targets": [f"{ep['host']}:{ep['port']}"],
                            "labels": {"run_id": run, "attempt": str(n), "node": node},
                        }
                        for (run, n, node), ep in registry.endpoints.items()
                    ]
                data = json.dumps(groups).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> EndpointRegistry:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def for_run(self, run_id: str, attempt: int) -> dict[str, dict[str, object]]:
        with self.lock:
            return {
                node: ep
                for (r, n, node), ep in self.endpoints.items()
                if (r, n) == (run_id, attempt)
            }
