"""Consumer settings and helpers shared by the reader and the deferred route fetcher."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException

from stage.client.connection import kafka_logger
from stage.wire import DEFAULT_MAX_RECORD_BYTES, AvroCodec, value_subject


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


# A reader's default max_record_bytes is the stage's (StageConfig.max_record_bytes, the one
# constant stage.wire.DEFAULT_MAX_RECORD_BYTES): a reader must use the stage's value, whatever it
# is, or it cannot fetch or decode the largest records it publishes.


def fetch_limits(max_record_bytes: int) -> dict:
    """librdkafka's fetch limits for records up to ``max_record_bytes``, as the stage sizes its
    own consumer (stage.runtime.kafka.clients): a batch holds one record of the cap plus framing."""
    fetch = max(max_record_bytes + (1 << 20), 52_428_800)
    return {"fetch.max.bytes": fetch, "max.partition.fetch.bytes": max_record_bytes + (1 << 20),
            "receive.message.max.bytes": fetch + 1_000_000}


def reader_defaults(bootstrap_servers: str, group_id: str,
                    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict:
    return {"bootstrap.servers": bootstrap_servers, "group.id": group_id,
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "isolation.level": "read_committed", "logger": kafka_logger(), **fetch_limits(max_record_bytes)}


# librdkafka's FAIL line for a fetch response over receive.message.max.bytes. It only logs it and
# fetches the same again every second, for ever: no error reaches the consumer.
_OVERSIZE = re.compile(r"Invalid response size (\d+) \(0\.\.(\d+)\)")


class ClientLog:
    """A reader's librdkafka ``logger``: every line goes on to the rate-limited ``stage.kafka``
    logger, and the first that says a fetch response was too large to receive is kept as
    ``oversize`` (response bytes, receive.message.max.bytes), so the reader can stop on it."""

    def __init__(self) -> None:
        self.logger = kafka_logger()
        self.oversize: tuple[int, int] | None = None

    def log(self, level: int, msg: str, *args) -> None:
        if self.oversize is None and args:
            match = _OVERSIZE.search(str(args[-1]))
            if match:
                self.oversize = (int(match.group(1)), int(match.group(2)))
        self.logger.log(level, msg, *args)


def oversize_error(response_bytes: int, receive_limit: int, max_record_bytes: int) -> str:
    """What UnreadableRecord says of a fetch response over the receive limit: the record in it is
    smaller than the response, so max_record_bytes of the response's size fetches and decodes it."""
    return (f"a fetch response of {response_bytes} bytes is over this reader's "
            f"receive.message.max.bytes ({receive_limit}), so a record there is larger than this "
            f"reader's max_record_bytes ({max_record_bytes}) allows; create the reader with "
            f"max_record_bytes={response_bytes} or more (the stage's value), which raises every fetch "
            f"limit with it")


def codec_for(name: str, topic: str, framing: str, schema_registry_url: str | None,
              max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
              schema_registry_config: Mapping[str, Any] | None = None) -> AvroCodec:
    registry = None
    if framing == "confluent":
        from stage.client.registry import schema_registry_client
        registry = schema_registry_client(schema_registry_url, schema_registry_config)
    return AvroCodec(name, framing=framing, registry=registry, subject=value_subject(topic),
                     max_record_bytes=max_record_bytes)


class UnreadableRecord(RuntimeError):
    """A record the reader cannot use. The reader stops before it (its position and commits
    stay below the record) instead of skipping it: a checkpointing trainer must not lose a
    group to a reader misconfigured for the stage."""

    def __init__(self, what: str, topic: str, partition: int, offset: int, error, max_record_bytes: int):
        super().__init__(
            f"{what} at {topic}[{partition}]@{offset} cannot be read: {error}. The reader stopped "
            f"before it (position() and commit() do not pass it). If the stage's max_record_bytes "
            f"is above this reader's ({max_record_bytes}), create the reader with "
            f"max_record_bytes=<the stage's> (DeferredRouteFetcher too); if the stage's framing or "
            f"schema registry differ from this reader's, use the stage's; else inspect the record "
            f"(`rollout-reassembler inspect`) and report it")
        self.topic, self.partition, self.offset = topic, partition, offset


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
