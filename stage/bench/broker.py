"""The broker a benchmark runs against: the one given, else a local KRaft broker from the Kafka
jars (`make kafka-jars`), stopped afterwards."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def bench_broker(bootstrap: str | None, **kraft_options):
    """Yields (bootstrap servers, a description for the report)."""
    if bootstrap is not None:
        yield bootstrap, bootstrap
        return
    from stage.brokers.kraft import KraftBroker, jars_available
    if not jars_available():
        raise RuntimeError("no --bootstrap-servers and no local Kafka jars (make kafka-jars)")
    broker = KraftBroker(**kraft_options).start()
    try:
        yield broker.bootstrap, "local KRaft (Apache Kafka jars)"
    finally:
        broker.discard()   # its log directory: an agentic-moe run leaves GBs of topic data


def produce(producer, topic: str, **kwargs) -> None:
    """``producer.produce``, waiting while librdkafka's local queue is full: a group with routes
    is hundreds of MB, more than its queue (1 GiB by default) holds when the benchmark produces
    faster than the broker takes them. Serves delivery callbacks while it waits."""
    while True:
        try:
            producer.produce(topic, **kwargs)
            return
        except BufferError:
            producer.poll(0.05)
