"""Fixtures of the fault suites."""

from __future__ import annotations

import pytest

from tests.support.kraft import KraftBroker, jars_available

# KIP-848 takes the session timeout and heartbeat interval from the brokers (min 45 s by
# default): a broker of its own with them as short as the classic cases' client settings
# (session.timeout.ms 6000, heartbeat.interval.ms 500 in tests/integration/harness.py).
KIP848_BROKER = {"group.consumer.min.session.timeout.ms": "3000", "group.consumer.session.timeout.ms": "6000",
                 "group.consumer.min.heartbeat.interval.ms": "500",
                 "group.consumer.heartbeat.interval.ms": "500"}


@pytest.fixture(scope="session")
def kip848_broker():
    """A JVM broker for the group_protocol consumer (KIP-848) cases."""
    if not jars_available():
        pytest.skip("the KIP-848 cases run on a JVM broker of their own: `make kafka-jars`")
    broker = KraftBroker(props=KIP848_BROKER).start()
    yield broker
    broker.discard()
