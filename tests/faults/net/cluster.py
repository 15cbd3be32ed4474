"""A 3-broker KRaft cluster (replication 3, min ISR 2, small heaps) behind Toxiproxy.

Each broker has, besides its controller listener, the PLAINTEXT listener (inter-broker traffic,
the feeder and the verifier: never faulted) and one listener per stage replica (``CLIENT_A``,
``CLIENT_B``...), advertised at that replica's own Toxiproxy proxy for that broker. A client gets
the advertised addresses of the listener it bootstrapped through, so a replica bootstrapped at
its proxies reaches every broker (leaders, group and transaction coordinators) only through
them: "cut replica a from broker 2" is a toxic on proxy ``a-2``, and the other replica, the
brokers and the verifier go on.
"""

from __future__ import annotations

from pathlib import Path

from stage.brokers.kraft import KraftCluster, free_port
from tests.faults.protocols import KIP848_BROKER
from tests.faults.net.toxiproxy import Toxiproxy

TX_LOG_PARTITIONS = 4   # KraftBroker's transaction.state.log.num.partitions


def java_string_hash(text: str) -> int:
    """Java's String.hashCode (UTF-16 code units), as a signed 32-bit int."""
    data, h = text.encode("utf-16-be"), 0
    for i in range(0, len(data), 2):
        h = (31 * h + (data[i] << 8 | data[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def transaction_log_partition(transactional_id: str, partitions: int = TX_LOG_PARTITIONS) -> int:
    """The __transaction_state partition whose leader coordinates ``transactional_id``: Kafka's
    TransactionStateManager.partitionFor, Utils.abs(hashCode) % partitions (confluent-kafka's
    admin client has no FindCoordinator or DescribeTransactions call)."""
    h = java_string_hash(transactional_id)
    return (0 if h == -(1 << 31) else abs(h)) % partitions


class ProxiedCluster:
    """``start()``; ``bootstrap`` (direct, unfaulted); ``bootstrap_for(client)`` (through that
    client's proxies); ``proxy_name(client, node)`` for the Toxiproxy calls; ``discard()``."""

    def __init__(self, workdir: Path, toxiproxy: Toxiproxy, clients=("a", "b"), heap: str = "384m") -> None:
        self.toxiproxy = toxiproxy
        self.clients = tuple(clients)
        self.kraft = KraftCluster(3, heap=heap, props=KIP848_BROKER)   # both group protocols
        self.proxy_ports: dict[tuple[str, int], int] = {}
        for node in self.kraft.nodes:
            listeners = [f"PLAINTEXT://127.0.0.1:{node.port}", f"CONTROLLER://127.0.0.1:{node.controller_port}"]
            advertised = [f"PLAINTEXT://127.0.0.1:{node.port}"]
            names = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
            for client in self.clients:
                listener, real = f"CLIENT_{client.upper()}", free_port()
                proxy = toxiproxy.proxy(self.proxy_name(client, node.node_id), f"127.0.0.1:{real}")
                self.proxy_ports[(client, node.node_id)] = proxy
                listeners.append(f"{listener}://127.0.0.1:{real}")
                advertised.append(f"{listener}://127.0.0.1:{proxy}")
                names.append(f"{listener}:PLAINTEXT")
            node.props.update({"listeners": ",".join(listeners),
                               "advertised.listeners": ",".join(advertised),
                               "listener.security.protocol.map": ",".join(names)})

    @staticmethod
    def proxy_name(client: str, node_id: int) -> str:
        return f"{client}-{node_id}"

    @property
    def bootstrap(self) -> str:
        return self.kraft.bootstrap

    @property
    def node_ids(self) -> list[int]:
        return [node.node_id for node in self.kraft.nodes]

    def bootstrap_for(self, client: str) -> str:
        return ",".join(f"127.0.0.1:{self.proxy_ports[(client, n)]}" for n in self.node_ids)

    def start(self) -> "ProxiedCluster":
        self.kraft.start()
        return self

    def transaction_coordinator(self, transactional_id: str) -> int:
        """The broker leading the transaction log partition of ``transactional_id``."""
        from confluent_kafka import Consumer
        reader = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "coordinator-lookup"})
        try:
            topic = reader.list_topics("__transaction_state", timeout=10).topics["__transaction_state"]
            return topic.partitions[transaction_log_partition(transactional_id)].leader
        finally:
            reader.close()

    def discard(self) -> None:
        self.kraft.discard()
