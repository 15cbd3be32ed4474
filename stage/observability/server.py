"""HTTP endpoints: /metrics (Prometheus text), /healthz (the poll loop is making progress),
/readyz (partitions assigned, their ledgers loaded, none halted, the Schema Registry answering). Liveness never depends on the broker
being reachable: a stuck loop is what a restart fixes, a broker outage is not."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


class HealthServer:
    def __init__(self, runtime, port: int, *, host: str = "0.0.0.0", stall_seconds: float = 60.0) -> None:
        self.runtime = runtime
        self.stall_seconds = stall_seconds
        handler = self._handler()
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="health-http", daemon=True)

    def start(self) -> "HealthServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def healthy(self) -> tuple[bool, str]:
        idle = time.monotonic() - self.runtime.stats.last_loop_at
        if idle > self.stall_seconds:
            return False, f"poll loop stalled for {idle:.0f}s"
        return True, f"poll loop active {idle:.1f}s ago"

    def ready(self) -> tuple[bool, str]:
        """(ready, why): partitions assigned and loaded, none halted, the registry answering."""
        return self.runtime.readiness()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server naming
                if self.path.startswith("/metrics"):
                    body = generate_latest(server.runtime.stats.sink.registry)
                    self._send(200, body, CONTENT_TYPE_LATEST)
                elif self.path.startswith("/healthz"):
                    ok, text = server.healthy()
                    self._send(200 if ok else 503, (text + "\n").encode(), "text/plain")
                elif self.path.startswith("/readyz"):
                    ok, text = server.ready()
                    self._send(200 if ok else 503, (text + "\n").encode(), "text/plain")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes every few seconds: keep logs quiet
                pass

        return Handler
