"""The contract's partitioner: Kafka's Java murmur2, byte for byte, and librdkafka's
``murmur2_random`` (what the SDK sets) places keyed records where it says."""

import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from stage.wire.partitioner import LIBRDKAFKA_PARTITIONER, murmur2, partition_for

# org.apache.kafka.common.utils.UtilsTest#testMurmur2 (the Java client's own vectors)
JAVA_VECTORS = {
    "21": -973932308,
    "foobar": -790332482,
    "a-little-bit-long-string": -985981536,
    "a-little-bit-longer-string": -1486304829,
    "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    "abc": 479470107,
}


@pytest.mark.parametrize("text,expected", JAVA_VECTORS.items())
def test_murmur2_matches_the_java_client(text, expected):
    assert murmur2(text.encode()) == expected


def test_partition_is_the_positive_hash_modulo_the_count():
    assert partition_for(b"21", 7) == (-973932308 & 0x7FFFFFFF) % 7
    assert {partition_for(f"g{i}".encode(), 12) for i in range(500)} == set(range(12))
    with pytest.raises(ValueError):
        partition_for(b"g", 0)


def test_librdkafka_murmur2_random_places_keys_where_the_contract_says(kafka):
    topic, partitions = f"partitioner-{uuid.uuid4().hex[:8]}", 7
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result()
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "partitioner": LIBRDKAFKA_PARTITIONER})
    placed, keys = {}, [f"group-{i}-{uuid.uuid4().hex[:4]}" for i in range(200)] + ["", "é", "21"]

    def delivered(err, msg):
        assert err is None, err
        placed[msg.key()] = msg.partition()

    producer.list_topics(topic, timeout=10)
    for key in keys:
        producer.produce(topic, key=key.encode(), value=b"x", on_delivery=delivered)
    assert producer.flush(30) == 0
    assert placed == {key.encode(): partition_for(key.encode(), partitions) for key in keys}
