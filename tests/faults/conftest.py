"""Fixtures of the fault suites."""

from __future__ import annotations

import pytest

from tests.faults.protocols import KIP848_BROKER
from tests.support.kraft import KraftBroker, jars_available

@pytest.fixture(scope="session")
def kip848_broker():
    """A JVM broker for the group_protocol consumer (KIP-848) cases."""
    if not jars_available():
        pytest.skip("the KIP-848 cases run on a JVM broker of their own: `make kafka-jars`")
    broker = KraftBroker(props=KIP848_BROKER).start()
    yield broker
    broker.discard()
