"""Consumer settings and helpers shared by the reader and the deferred route fetcher."""

from __future__ import annotations

from confluent_kafka import Consumer

from stage.wire import AvroCodec, value_subject


def take(consumer: Consumer, max_records: int, timeout: float) -> list:
    """Up to ``max_records`` messages: whatever is already fetched, else wait at most
    ``timeout`` for the first one (``Consumer.consume`` would wait the whole timeout for a
    full batch)."""
    messages = consumer.consume(max_records, 0)
    if messages:
        return messages
    first = consumer.poll(timeout)
    if first is None:
        return []
    return [first, *consumer.consume(max_records - 1, 0)] if max_records > 1 else [first]


def reader_defaults(bootstrap_servers: str, group_id: str) -> dict:
    fetch = 64 << 20
    return {"bootstrap.servers": bootstrap_servers, "group.id": group_id,
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "isolation.level": "read_committed", "fetch.max.bytes": fetch,
            "max.partition.fetch.bytes": fetch, "receive.message.max.bytes": fetch + (2 << 20)}


def codec_for(name: str, topic: str, framing: str, schema_registry_url: str | None) -> AvroCodec:
    registry = None
    if framing == "confluent":
        from confluent_kafka.schema_registry import SchemaRegistryClient
        registry = SchemaRegistryClient({"url": schema_registry_url})
    return AvroCodec(name, framing=framing, registry=registry, subject=value_subject(topic))
