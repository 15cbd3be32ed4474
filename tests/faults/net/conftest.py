"""The network fault suite's cluster: one Toxiproxy server and one 3-broker KRaft cluster behind
it for the module (tests/faults/net/cluster.py), both stopped and removed at its end."""

import pytest

from tests.faults.net.cluster import ProxiedCluster
from tests.faults.net.toxiproxy import Toxiproxy, require_toxiproxy
from tests.support.kraft import jars_available


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    binary = require_toxiproxy()
    if not jars_available():
        pytest.skip("the Kafka jars are not resolved (`make kafka-jars`)")
    toxiproxy = Toxiproxy(binary, tmp_path_factory.mktemp("toxiproxy") / "toxiproxy.log")
    cluster = None
    try:
        cluster = ProxiedCluster(tmp_path_factory.mktemp("net"), toxiproxy).start()
        print(f"3-broker KRaft cluster at {cluster.bootstrap}; replica a at {cluster.bootstrap_for('a')}, "
              f"b at {cluster.bootstrap_for('b')}")
        yield cluster
    finally:
        if cluster is not None:
            cluster.discard()
        toxiproxy.stop()
