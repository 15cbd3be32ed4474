"""The broker image the suite runs (KAFKA_TEST_IMAGE: apache/kafka, or the one
tools/docker/images.sh builds here with the same conventions): KAFKA_* variables become broker
properties, the JVM and log4j variables do not, storage lands in KAFKA_LOG_DIRS (the compose
volume), and the compose file's healthcheck command answers."""

from __future__ import annotations

from stage.brokers.kraft import free_port
from tests.docker.support import Container, docker, image, wait_for
from tests.support.docker_broker import broker_environment


def test_environment_becomes_properties_and_data_lands_in_the_log_dir():
    name = image("KAFKA_TEST_IMAGE", "kafka")
    port, controller = free_port(), free_port()
    env = {**broker_environment(port, controller, "127.0.0.1", host_network=True),
           "KAFKA_LOG_DIRS": "/var/lib/kafka/data",
           "KAFKA_LOG_RETENTION_MS": "86400000",
           "KAFKA_CONNECTIONS_MAX_IDLE_MS": "600000"}
    options = [item for key, value in env.items() for item in ("-e", f"{key}={value}")]
    broker = Container(name, options=tuple(options))
    try:
        probe = ["exec", broker.name, "/opt/kafka/bin/kafka-broker-api-versions.sh",
                 "--bootstrap-server", f"127.0.0.1:{port}"]
        wait_for("the compose healthcheck command", lambda: docker(*probe, check=False).returncode == 0,
                 120, broker.logs)
        properties = dict(line.split("=", 1) for line in
                          docker("exec", broker.name, "cat", "/opt/kafka/config/server.properties").stdout.split())
        assert properties["log.retention.ms"] == "86400000"
        assert properties["connections.max.idle.ms"] == "600000"
        assert properties["transaction.state.log.min.isr"] == "1"
        assert properties["listeners"] == f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}"
        assert not any(key.startswith(("heap", "log4j", "opts")) for key in properties), properties
        data = docker("exec", broker.name, "ls", "/var/lib/kafka/data").stdout.split()
        assert "meta.properties" in data and "__cluster_metadata-0" in data
        assert "INFO" in broker.logs()  # the broker's own log reaches the container output
    finally:
        broker.remove()
