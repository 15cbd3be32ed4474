"""A trainer's reader at its default cap (max_record_bytes, stage.wire.DEFAULT_MAX_RECORD_BYTES) meeting a row the stage
published under a raised cap (issue 29 item 12): librdkafka cannot even receive the fetch
response ("Invalid response size ... increase receive.message.max.bytes", retried every second
for ever) and the reader returned nothing, for ever. It must stop at once with UnreadableRecord
naming exactly what to set, as it does when only its fetch limits are raised."""

from __future__ import annotations

import re

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from stage.client import CanonicalReader, DeferredRouteFetcher
from stage.client.consuming import UnreadableRecord, fetch_limits
from stage.runtime.kafka.topics import create_topics
from stage.wire import DEFAULT_MAX_RECORD_BYTES
from tests.integration.harness import ONE_BROKER, stage_config, unique_topics

DEFAULT_RECEIVE = fetch_limits(DEFAULT_MAX_RECORD_BYTES)["receive.message.max.bytes"]
ROW_BYTES = DEFAULT_RECEIVE + (4 << 20)       # one record over what the default reader can receive


def test_a_row_over_the_readers_receive_limit_stops_it_naming_what_to_set(kafka):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    create_topics(AdminClient({"bootstrap.servers": kafka.bootstrap}), cfg, partitions=1,
                  max_message_bytes=ROW_BYTES + (1 << 20), **ONE_BROKER)
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "message.max.bytes": ROW_BYTES + (1 << 20)})
    producer.produce(topics.canonical_rows, key=b"g", value=bytes(ROW_BYTES))
    assert producer.flush(60) == 0
    with CanonicalReader(kafka.bootstrap, topics=topics) as reader:
        with pytest.raises(UnreadableRecord) as stopped:
            reader.read(1, timeout=60)
        text = str(stopped.value)
        print(f"\n{text}")
        assert f"{topics.canonical_rows}[0]@0" in text
        assert "max_record_bytes=" in text and "receive.message.max.bytes" in text
        assert stopped.value.offset == 0
        with pytest.raises(UnreadableRecord):       # and on every later read
            reader.read(1, timeout=1)
        assert reader.position().offsets() == {(topics.canonical_rows, 0): None}   # never past it
    # what it says to set is enough: the record is fetched, and (not a row) fails to decode
    suggested = int(re.search(r"max_record_bytes=(\d+) or more", text).group(1))
    with CanonicalReader(kafka.bootstrap, topics=topics, max_record_bytes=suggested) as reader:
        with pytest.raises(UnreadableRecord) as undecodable:
            reader.read(1, timeout=60)
    assert "fetch response" not in str(undecodable.value) and undecodable.value.offset == 0
    # the deferred route fetcher, reading a staged call that large, stops the same way
    with DeferredRouteFetcher(kafka.bootstrap, dims=(2, 2), timeout=30) as fetcher:
        with pytest.raises(UnreadableRecord) as fetch_stopped:
            fetcher.fetch([(topics.canonical_rows, 0, 0)])
    assert f"{topics.canonical_rows}[0]@0" in str(fetch_stopped.value)
    assert f"max_record_bytes={suggested} or more" in str(fetch_stopped.value)
