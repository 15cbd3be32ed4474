"""A single-node KRaft broker in a container, from ``apache/kafka`` 4.x or the image that
``tools/docker/images.sh`` builds without a registry (same conventions: KAFKA_* variables become
broker properties). ``KAFKA_TEST_IMAGE`` names the image; ``KAFKA_TEST_DOCKER_NETWORK``
(``auto``, ``host``, ``ports``) chooses host networking or a mapped port (auto: host networking
when the engine has no default bridge, as where dockerd runs with ``--bridge=none``).

Generic testcontainers ``DockerContainer``, not its ``KafkaContainer``: that one runs Confluent's
start-up scripts and refuses apache/kafka tags for KRaft. Ryuk (testcontainers' reaper) needs its
image from a registry; where it is not present locally it is disabled and this class removes the
container itself, also when the start fails.
"""

from __future__ import annotations

import os

from stage.brokers.kraft import MESSAGE_MAX_BYTES, free_port, wait_ready

DEFAULT_IMAGE = "apache/kafka:4.1.0"
# Containers the tests start carry this label: `tools/docker/engine.sh` removes leftovers of a
# killed test run by it, and nothing else.
TEST_LABEL = "org.rollout-reassembler.test"
CLUSTER_ID = "rr-test-cluster-000001"


def broker_environment(port: int, controller_port: int, advertised_host: str, *, host_network: bool) -> dict:
    """apache/kafka's KAFKA_* variables for one combined KRaft node fit for transactions."""
    bind = "127.0.0.1" if host_network else "0.0.0.0"
    return {
        "CLUSTER_ID": CLUSTER_ID,
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": f"PLAINTEXT://{bind}:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://{advertised_host}:{port}",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": f"1@127.0.0.1:{controller_port}",
        "KAFKA_INTER_BROKER_LISTENER_NAME": "PLAINTEXT",
        # one node: internal topics cannot have more replicas (init_transactions hangs otherwise)
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "4",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_NUM_PARTITIONS": "4",
        "KAFKA_TRANSACTION_MAX_TIMEOUT_MS": "900000",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
        "KAFKA_MESSAGE_MAX_BYTES": str(MESSAGE_MAX_BYTES),
        "KAFKA_REPLICA_FETCH_MAX_BYTES": str(MESSAGE_MAX_BYTES),
        "KAFKA_HEAP_OPTS": "-Xms512m -Xmx1g",
    }


class ImageUnavailable(RuntimeError):
    """The broker image is neither present nor pullable (no registry answers)."""


def _has_bridge(client) -> bool:
    return any(n.name == "bridge" for n in client.networks.list(names=["bridge"]))


def _image_present(client, image: str) -> bool:
    import docker.errors
    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False


def _disable_ryuk_without_its_image(client) -> None:
    from testcontainers.core.config import testcontainers_config as config
    if "TESTCONTAINERS_RYUK_DISABLED" not in os.environ and not _image_present(client, config.ryuk_image):
        config.ryuk_disabled = True


class ContainerBroker:
    kind = "docker"

    def __init__(self, image: str | None = None, network: str | None = None) -> None:
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.docker_client import DockerClient

        self.image = image or os.environ.get("KAFKA_TEST_IMAGE") or DEFAULT_IMAGE
        client = DockerClient()
        network = network or os.environ.get("KAFKA_TEST_DOCKER_NETWORK", "auto")
        if network not in ("auto", "host", "ports"):
            raise ValueError(f"KAFKA_TEST_DOCKER_NETWORK must be auto, host or ports, got {network!r}")
        self.host_network = network == "host" or (network == "auto" and not _has_bridge(client.client))
        _disable_ryuk_without_its_image(client.client)
        self.port, controller_port = free_port(), free_port()
        host = "127.0.0.1" if self.host_network else client.host()
        self.bootstrap = f"{host}:{self.port}"
        self._ensure_image(client.client)
        self._stopped = False
        self.container = DockerContainer(self.image)
        for key, value in broker_environment(self.port, controller_port, host, host_network=self.host_network).items():
            self.container.with_env(key, value)
        if self.host_network:
            self.container.with_kwargs(labels={TEST_LABEL: "kafka"}, network_mode="host")
        else:
            self.container.with_kwargs(labels={TEST_LABEL: "kafka"})
            self.container.with_bind_ports(self.port, self.port)  # advertised port == host port

    def _ensure_image(self, client) -> None:
        import docker.errors
        if _image_present(client, self.image):
            return
        try:
            client.images.pull(self.image)
        except docker.errors.APIError as error:
            raise ImageUnavailable(f"{self.image} is not present and cannot be pulled ({error}); "
                                   "build it here with `tools/docker/images.sh kafka`") from error

    @property
    def description(self) -> str:
        network = "host network" if self.host_network else "mapped port"
        return f"docker {self.image} ({network}) at {self.bootstrap}"

    def start(self, timeout: float = 120.0) -> "ContainerBroker":
        try:
            self.container.start()
            wait_ready(self.bootstrap, timeout, alive=self._running, where=self.log_tail)
        except BaseException:
            self.stop()  # a failed start must not leave the container running
            raise
        return self

    def _running(self) -> bool:
        container = self.container.get_wrapped_container()
        container.reload()
        return container.status in ("created", "running")

    def log_tail(self, lines: int = 200) -> str:
        """The broker's log (the container's output), last lines."""
        try:
            return self.container.get_wrapped_container().logs(tail=lines).decode(errors="replace")
        except Exception as error:  # noqa: BLE001 - the container may be gone
            return f"(no container log: {error})"

    def stop(self) -> None:
        """Removes the container with its volumes; a second call does nothing."""
        if not self._stopped:
            self._stopped = True
            self.container.stop()
