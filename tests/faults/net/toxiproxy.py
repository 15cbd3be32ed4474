"""Toxiproxy's server (``make toxiproxy`` builds it into .cache/bin) driven over its HTTP API.

The API is four JSON calls (create a proxy, add and remove a toxic, reset), so plain urllib
serves: the one Python client on PyPI (toxiproxy-python 0.1.1) has not been released since 2019.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from stage.brokers.kraft import _die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[3]
BINARY = ROOT / ".cache" / "bin" / "toxiproxy-server"


def require_toxiproxy() -> Path:
    """The server binary; skips the test without it, except under CI (`CI` set, as .ci/run
    runs), where `make test` must have built it."""
    if BINARY.is_file() and os.access(BINARY, os.X_OK):
        return BINARY
    if os.environ.get("CI"):
        pytest.fail(f"{BINARY} is missing under CI: `make toxiproxy` (part of `make test`) did not build it")
    if shutil.which("go") is None:
        pytest.skip("toxiproxy-server needs the Go toolchain (`make toxiproxy`): no `go` on this machine")
    pytest.skip("toxiproxy-server is not built: run `make toxiproxy` (or `make test`)")


class Toxiproxy:
    """One server on a free loopback port; ``proxy()`` adds a TCP proxy, ``toxic()`` a fault."""

    def __init__(self, binary: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([str(binary), "-host", "127.0.0.1", "-port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 20
        while True:
            try:
                self._call("GET", "/version")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"toxiproxy-server did not start; see {log_path}") from None
                time.sleep(0.1)

    def _call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"toxiproxy {method} {path}: {error.code} {error.read().decode()}") from None
        return json.loads(text) if text.strip().startswith(("{", "[")) else text

    def proxy(self, name: str, upstream: str) -> int:
        """A proxy ``name`` listening on a free loopback port (returned), forwarding to ``upstream``."""
        port = free_port()
        self._call("POST", "/proxies", {"name": name, "listen": f"127.0.0.1:{port}",
                                        "upstream": upstream, "enabled": True})
        return port

    def toxic(self, proxy: str, kind: str, stream: str = "downstream", toxicity: float = 1.0,
              **attributes) -> str:
        """Adds a toxic (``latency``, ``timeout``, ``bandwidth``, ``reset_peer``, ``slow_close``,
        ``slicer``...) to one direction of ``proxy``; returns its name for ``remove()``."""
        name = f"{kind}_{stream}"
        self._call("POST", f"/proxies/{proxy}/toxics", {"name": name, "type": kind, "stream": stream,
                                                        "toxicity": toxicity, "attributes": attributes})
        return name

    def remove(self, proxy: str, toxic: str) -> None:
        self._call("DELETE", f"/proxies/{proxy}/toxics/{toxic}")

    def enable(self, proxy: str, enabled: bool) -> None:
        """Disabled: the listener closes and every connection through it is cut (refused, reset)."""
        self._call("POST", f"/proxies/{proxy}", {"enabled": enabled})

    def toxics(self, proxy: str) -> list[dict]:
        return self._call("GET", f"/proxies/{proxy}/toxics")

    def reset(self) -> None:
        """Every proxy enabled, every toxic removed (what a healed network is)."""
        self._call("POST", "/reset")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
