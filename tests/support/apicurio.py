"""A real Schema Registry for the tests: Apicurio Registry's Quarkus distribution (Maven
Central, ``make apicurio-registry`` unpacks it into .cache/apicurio/<version>) on a JVM >= 21,
serving Confluent's REST API at ``/apis/ccompat/v7``.

Settings that make it behave as the stage expects a registry to: global compatibility BACKWARD
(Confluent's default; Apicurio's is NONE), the management interface (health) on loopback
instead of 0.0.0.0, a free port, a heap of 128 MiB, its own directory for the log and data.
Options: HTTP basic auth enforced against embedded users (``users``), an HTTPS port with a
server certificate (``tls``), and storage in an H2 database file (``persistent``) so that a
restarted registry still knows every schema and id, as a production registry's storage does
(Apicurio's default H2 in memory forgets them on restart).

``apicurio_unavailable()`` says why the tests cannot run one (no distribution, no Java 21);
``require_apicurio()`` skips with that reason, or fails under CI (``CI`` set, as .ci/run
runs), where `make test` must have provided it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from stage.brokers.kraft import _die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[2]
CCOMPAT = "/apis/ccompat/v7"
MIN_JAVA = 21


def _makefile_version() -> str:
    match = re.search(r"^APICURIO_VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    return match.group(1) if match else "unknown"


VERSION = _makefile_version()
DIST = Path(os.environ.get("APICURIO_REGISTRY_DIST", ROOT / ".cache" / "apicurio" / VERSION))


def _java_major(java: Path) -> int:
    """The major version of a JDK's java: from its home's ``release`` file (no JVM started)."""
    release = java.resolve().parent.parent / "release"
    try:
        match = re.search(r'^JAVA_VERSION="(\d+)', release.read_text(), re.M)
    except OSError:
        match = None
    if match:
        return int(match.group(1))
    try:
        out = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired):
        return 0
    match = re.search(r'version "(\d+)', out)
    return int(match.group(1)) if match else 0


def find_java(minimum: int = MIN_JAVA) -> Path | None:
    """A java of at least ``minimum``: $APICURIO_JAVA, $JAVA_HOME, `java` on PATH, /usr/lib/jvm/*."""
    candidates = [os.environ.get("APICURIO_JAVA"),
                  os.environ.get("JAVA_HOME") and str(Path(os.environ["JAVA_HOME"]) / "bin" / "java"),
                  shutil.which("java"),
                  *sorted(str(p) for p in Path("/usr/lib/jvm").glob("*/bin/java"))]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and _java_major(Path(candidate)) >= minimum:
            return Path(candidate)
    return None


def apicurio_unavailable() -> str | None:
    """Why no Apicurio Registry can start here, or None."""
    if not (DIST / "quarkus-run.jar").is_file():
        return (f"Apicurio Registry {VERSION} is not in {DIST}: run `make apicurio-registry` "
                "(Maven Central, part of `make test`)")
    if find_java() is None:
        return (f"Apicurio Registry {VERSION} needs Java >= {MIN_JAVA}: none in $APICURIO_JAVA, "
                "$JAVA_HOME, PATH or /usr/lib/jvm")
    return None


def require_apicurio() -> None:
    reason = apicurio_unavailable()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (under CI the Schema Registry tests must run)")
    pytest.skip(reason)


@dataclass(frozen=True)
class ServerTls:
    """PEM files of the registry's HTTPS port."""
    cert: Path
    key: Path


class ApicurioRegistry:
    """``start()`` / ``stop()`` (SIGTERM) / ``kill()`` (SIGKILL), restartable on the same ports.
    ``url`` is the Confluent-compatible API over HTTP, ``https_url`` over HTTPS (with ``tls``)."""

    kind = "apicurio"
    # A test registry serves a few hundred requests: C1 only and the serial collector start it
    # faster and smaller than the JVM's defaults (measured on the 2-core machine, 3 starts each:
    # 2.7-3.5 s and 215 MiB RSS against 4.0-6.6 s and 229-243 MiB).
    JVM_FLAGS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")

    def __init__(self, workdir: str | Path | None = None, *, users: dict[str, str] | None = None,
                 tls: ServerTls | None = None, persistent: bool = False, heap: str = "128m") -> None:
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="apicurio-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port, self.management_port = free_port(), free_port()
        self.https_port = free_port() if tls else None
        self.users = dict(users or {})
        self.tls = tls
        self.persistent = persistent
        self.heap = heap
        self.java = find_java()
        self.proc: subprocess.Popen | None = None
        self.started_in_s: float | None = None     # the last start's time until it answered
        self.rss_at_stop: int | None = None        # bytes, read just before the last stop
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{CCOMPAT}"

    @property
    def https_url(self) -> str:
        return f"https://127.0.0.1:{self.https_port}{CCOMPAT}"

    @property
    def description(self) -> str:
        extras = [x for x in ("basic auth" if self.users else "", "https" if self.tls else "",
                              "H2 file storage" if self.persistent else "in-memory storage") if x]
        timing = f", started in {self.started_in_s:.1f}s" if self.started_in_s else ""
        rss = self.rss_bytes() if self.proc and self.proc.poll() is None else self.rss_at_stop
        timing += f", RSS {rss / 2**20:.0f} MiB" if rss else ""
        return f"Apicurio Registry {VERSION} at {self.url} ({', '.join(extras)}{timing})"

    def _properties(self) -> dict[str, str]:
        props = {
            "quarkus.http.host": "127.0.0.1",
            "quarkus.http.port": str(self.port),
            "quarkus.management.host": "127.0.0.1",
            "quarkus.management.port": str(self.management_port),
            "apicurio.rules.global.compatibility": "BACKWARD",
        }
        if self.persistent:
            props["apicurio.datasource.url"] = f"jdbc:h2:file:{self.dir / 'data' / 'registry'}"
        if self.users:
            # Apicurio's own authentication chain with Quarkus's basic mechanism and embedded
            # users: no identity server. Without RBAC every authenticated user may write.
            props.update({"apicurio.authn.enabled": "true", "quarkus.oidc.tenant-enabled": "false",
                          "apicurio.authn.mechanism.priority": "basic", "quarkus.http.auth.basic": "true",
                          "quarkus.security.users.embedded.enabled": "true",
                          "quarkus.security.users.embedded.plain-text": "true"})
            for user, password in self.users.items():
                props[f"quarkus.security.users.embedded.users.{user}"] = password
        if self.tls:
            # a named TLS configuration for the API only: health stays plain HTTP on loopback
            props.update({"quarkus.http.ssl-port": str(self.https_port),
                          "quarkus.http.tls-configuration-name": "registry",
                          "quarkus.tls.registry.key-store.pem.0.cert": str(self.tls.cert),
                          "quarkus.tls.registry.key-store.pem.0.key": str(self.tls.key)})
        return props

    def start(self, timeout: float = 120.0) -> "ApicurioRegistry":
        reason = apicurio_unavailable()
        if reason:
            raise RuntimeError(reason)
        command = [str(self.java), f"-Xmx{self.heap}", *self.JVM_FLAGS,
                   *(f"-D{k}={v}" for k, v in self._properties().items()),
                   "-jar", str(DIST / "quarkus-run.jar")]
        log = open(self.dir / "registry.log", "ab")
        started = time.monotonic()
        self.proc = subprocess.Popen(command, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        log.close()
        self.starts += 1
        self._wait_ready(started + timeout)
        self.started_in_s = time.monotonic() - started
        return self

    def _answers(self, url: str) -> bool:
        """Any HTTP answer counts (401 with auth): the server is up."""
        import ssl
        context = ssl._create_unverified_context() if url.startswith("https") else None
        try:
            with urllib.request.urlopen(url, timeout=2, context=context):
                return True
        except urllib.error.HTTPError:
            return True
        except (OSError, ValueError):
            return False

    def _wait_ready(self, deadline: float) -> None:
        # health on the management port first, then the API ports (they open a little later)
        checks = [f"http://127.0.0.1:{self.management_port}/health/ready", f"{self.url}/subjects"]
        if self.tls:
            checks.append(f"{self.https_url}/subjects")
        for check in checks:
            while not self._answers(check):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"Apicurio Registry exited during start-up (rc {self.proc.returncode}):\n"
                                       f"{self.log_tail(60)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Apicurio Registry not answering {check}:\n{self.log_tail(60)}")
                time.sleep(0.2)

    def rss_bytes(self) -> int | None:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except (OSError, AttributeError):
            return None
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        return int(match.group(1)) * 1024 if match else None

    def log_tail(self, lines: int = 200) -> str:
        path = self.dir / "registry.log"
        if not path.is_file():
            return f"(no registry log in {self.dir})"
        text = path.read_text(errors="replace").splitlines()[-lines:]
        return f"--- {path} ---\n" + "\n".join(line.rstrip() for line in text)

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful stop; the ports refuse connections afterwards."""
        if self.proc and self.proc.poll() is None:
            self.rss_at_stop = self.rss_bytes()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.rss_at_stop = self.rss_bytes()
            self.proc.kill()
            self.proc.wait()
