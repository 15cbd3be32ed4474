"""The contract's partitioner: which partition a key belongs in.

Every input and output topic is keyed by group_id and co-partitioned, so every producer of the
input topics must place a key exactly where the stage expects it: partition =
``toPositive(murmur2(utf8(key))) % partitions``, Kafka's Java client default (also what Kafka
Streams uses) and librdkafka's ``partitioner=murmur2_random`` for keyed records. librdkafka's
own default (``consistent_random``, CRC32) places keys elsewhere, so the SDK sets the
partitioner explicitly and the stage dead-letters any record found in another partition.
"""

from __future__ import annotations

_M = 0x5BD1E995
_SEED = 0x9747B28C
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's 32-bit murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``) as a signed int."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length % 4
    if tail == 3:
        h ^= data[whole + 2] << 16
    if tail >= 2:
        h ^= data[whole + 1] << 8
    if tail >= 1:
        h ^= data[whole]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition of ``key`` among ``partitions`` (Java's ``toPositive(murmur2) % n``)."""
    if partitions <= 0:
        raise ValueError(f"partitions must be positive, got {partitions}")
    return (murmur2(key) & 0x7FFFFFFF) % partitions


# librdkafka's name for the same placement (keyed records; unkeyed ones go anywhere).
LIBRDKAFKA_PARTITIONER = "murmur2_random"
