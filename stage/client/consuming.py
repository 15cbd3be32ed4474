"""Consumer settings and helpers shared by the reader and the deferred route fetcher."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException

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


def codec_for(name: str, topic: str, framing: str, schema_registry_url: str | None,
              schema_registry_config: Mapping[str, Any] | None = None) -> AvroCodec:
    registry = None
    if framing == "confluent":
        from stage.client.registry import schema_registry_client
        registry = schema_registry_client(schema_registry_url, schema_registry_config)
    return AvroCodec(name, framing=framing, registry=registry, subject=value_subject(topic))


# Transient states (a coordinator or leader moving, metadata not updated yet after a topic was
# created): librdkafka reports them from committed(), commit(), get_watermark_offsets() and
# offsets_for_times() without marking them retriable.
_TRANSIENT = {KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
              KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError._WAIT_COORD, KafkaError._TIMED_OUT,
              KafkaError._TRANSPORT, KafkaError.NOT_LEADER_FOR_PARTITION,
              KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART}


def retrying(fn, *, timeout: float = 30.0):
    """``fn()``, retried while it fails with a retriable Kafka error (a group coordinator still
    loading right after a broker start, a leader election) for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except KafkaException as error:
            kafka_error = error.args[0]
            transient = kafka_error.retriable() or kafka_error.code() in _TRANSIENT
            if not transient or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
