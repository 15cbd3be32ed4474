"""tests/support/docker_broker.py: a broker that fails to start leaves no container behind,
Ryuk is off where its image is absent, and the mapped-port mode (a laptop's bridge network)
serves transactions as the host-network mode does."""

from __future__ import annotations

import os
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.docker.support import docker, image
from tests.support.docker_broker import TEST_LABEL, ContainerBroker, _has_bridge


def test_a_failed_start_removes_the_container():
    image("KAFKA_TEST_IMAGE", "kafka")
    broker = ContainerBroker()
    broker.container.with_env("KAFKA_PROCESS_ROLES", "not-a-role")  # the broker exits at once
    with pytest.raises(RuntimeError, match="exited during start-up") as failure:
        broker.start(timeout=90)
    assert "not-a-role" in str(failure.value) or "process.roles" in str(failure.value)  # its log is attached
    container_id = broker.container.get_wrapped_container().id
    left = docker("ps", "-aq", "--no-trunc", "--filter", f"label={TEST_LABEL}").stdout.split()
    assert container_id not in left


def test_ryuk_is_disabled_where_its_image_is_absent(monkeypatch):
    image("KAFKA_TEST_IMAGE", "kafka")
    from testcontainers.core.config import testcontainers_config as config
    monkeypatch.delenv("TESTCONTAINERS_RYUK_DISABLED", raising=False)
    monkeypatch.setattr(config, "_ryuk_disabled", None)
    present = docker("image", "inspect", config.ryuk_image, check=False).returncode == 0
    ContainerBroker()  # not started
    assert config.ryuk_disabled is (not present)


def _transaction_round_trip(bootstrap: str) -> None:
    topic = f"tx-{uuid.uuid4().hex[:8]}"
    AdminClient({"bootstrap.servers": bootstrap}).create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": topic})
    producer.init_transactions(60)
    producer.begin_transaction()
    producer.produce(topic, b"committed")
    producer.commit_transaction(60)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": topic, "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        message = consumer.poll(30)
        assert message is not None and message.value() == b"committed"
    finally:
        consumer.close()


def test_mapped_port_mode_serves_transactions():
    image("KAFKA_TEST_IMAGE", "kafka")
    from testcontainers.core.docker_client import DockerClient
    if not _has_bridge(DockerClient().client):
        pytest.skip("this engine has no bridge network (dockerd --bridge=none): mapped ports cannot exist; "
                    "the host-network mode serves the whole suite instead")
    broker = ContainerBroker(network="ports").start()
    try:
        assert not broker.host_network and os.environ.get("KAFKA_TEST_DOCKER_NETWORK", "auto") in ("auto", "ports")
        _transaction_round_trip(broker.bootstrap)
    finally:
        broker.stop()
