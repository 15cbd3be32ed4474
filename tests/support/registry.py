"""A small HTTP server that speaks the part of Confluent Schema Registry's REST API the stage and
the SDK use (register a schema under a subject, look a schema up by id), and that can go down
and come back on the same port, as a real registry does in an outage."""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_REGISTER = re.compile(r"^/subjects/([^/?]+)/versions")
_LOOKUP = re.compile(r"^/subjects/([^/?]+)(\?|$)")
_BY_ID = re.compile(r"^/schemas/ids/(\d+)")


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True


class FakeRegistry:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.schemas: dict[int, str] = {}          # id -> schema string
        self.ids: dict[str, int] = {}              # schema string -> id
        self.subjects: dict[str, list[int]] = {}
        self.requests = 0
        self.status: int | None = None             # answer every request with this (e.g. 503)
        self._lock = threading.Lock()
        self._httpd: _Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- up and down -------------------------------------------------------------------------
    def start(self) -> "FakeRegistry":
        self._httpd = _Server(("127.0.0.1", self.port), self._handler())
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Connections are refused until start() again."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    # -- the API ---------------------------------------------------------------------------
    def _register(self, subject: str, body: dict) -> dict:
        schema = body["schema"]
        with self._lock:
            schema_id = self.ids.get(schema)
            if schema_id is None:
                schema_id = self.ids[schema] = 100 + len(self.ids)
                self.schemas[schema_id] = schema
            versions = self.subjects.setdefault(subject, [])
            if schema_id not in versions:
                versions.append(schema_id)
        return {"id": schema_id}

    def _handler(self):
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"{}")

            def do_POST(self):  # noqa: N802
                registry.requests += 1
                body = self._body()
                if registry.status is not None:
                    return self._reply(registry.status, {"error_code": registry.status, "message": "down"})
                match = _REGISTER.match(self.path)
                if match:
                    return self._reply(200, registry._register(match.group(1), body))
                match = _LOOKUP.match(self.path)
                if match:
                    schema_id = registry.ids.get(body.get("schema"))
                    if schema_id is None:
                        return self._reply(404, {"error_code": 40403, "message": "Schema not found"})
                    return self._reply(200, {"subject": match.group(1), "id": schema_id, "version": 1,
                                             "schema": body["schema"]})
                self._reply(404, {"error_code": 404, "message": "unknown path"})

            def do_GET(self):  # noqa: N802
                registry.requests += 1
                if registry.status is not None:
                    return self._reply(registry.status, {"error_code": registry.status, "message": "down"})
                match = _BY_ID.match(self.path)
                if match and int(match.group(1)) in registry.schemas:
                    return self._reply(200, {"schema": registry.schemas[int(match.group(1))]})
                self._reply(404, {"error_code": 40403, "message": "Schema not found"})

            def log_message(self, *args) -> None:
                pass

        return Handler
