"""Bounded reads of single partitions for the operator commands (``inspect``, ``dead-letters``).

Clients are built from the stage's configuration exactly as ``run`` builds its own
(``stage.runtime.kafka.clients``: bootstrap servers plus the ``kafka:`` and ``consumer:`` passthrough,
so SASL/TLS settings apply), read_committed, assigned by hand (no consumer-group join, nothing
committed). A scan reads ``[start, end)`` of one partition, where the bounds may come from
record timestamps (``offsets_for_times``), and reports its progress on stderr.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, TopicPartition

from stage.client.consuming import retrying
from stage.runtime.kafka.clients import reader_config
from stage.config.model import StageConfig


@dataclass(frozen=True)
class Record:
    """One Kafka record as read (value may be None: a tombstone or a null-valued record)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: tuple

    @property
    def where(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


class Progress:
    """At most one line a second on stderr, only for scans that take longer than that."""

    def __init__(self, enabled: bool = True, stream=None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._next = 0.0

    def start(self) -> None:
        self._next = time.monotonic() + 1.0

    def update(self, text: str) -> None:
        if self.enabled and time.monotonic() >= self._next:
            print(text, file=self.stream, flush=True)
            self._next = time.monotonic() + 1.0


class PartitionReader:
    """One consumer for a command's whole run; ``scan`` reads one partition range at a time."""

    def __init__(self, cfg: StageConfig, purpose: str, progress: Progress | None = None) -> None:
        self.consumer = Consumer({**reader_config(cfg, purpose), "fetch.wait.max.ms": 50})
        self.progress = progress or Progress(False)

    def partitions(self, topic: str) -> int | None:
        """The topic's partition count, None if it does not exist."""
        meta = self.consumer.list_topics(topic, timeout=15).topics.get(topic)
        if meta is None or meta.error is not None:
            return None
        return len(meta.partitions)

    def bounds(self, topic: str, partition: int) -> tuple[int, int]:
        """(low watermark, end): the first offset kept and one past the last readable one."""
        return retrying(lambda: self.consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=15))

    def offset_at(self, topic: str, partition: int, timestamp_ms: int | None, default: int) -> int:
        """The first offset whose record timestamp is >= ``timestamp_ms`` (``default`` when no
        timestamp is given or no record is that late)."""
        if timestamp_ms is None:
            return default
        (found,) = retrying(lambda: self.consumer.offsets_for_times(
            [TopicPartition(topic, partition, max(0, timestamp_ms))], timeout=15))
        return default if found.offset < 0 else found.offset

    def scan(self, topic: str, partition: int, start: int, end: int, match=None) -> tuple[list[Record], int]:
        """Records of ``[start, end)`` for which ``match(record)`` holds (all with no ``match``),
        and how many records were read. Only the matching records are kept."""
        out: list[Record] = []
        read = 0
        if end <= start:
            return out, read
        self.consumer.assign([TopicPartition(topic, partition, start)])
        self.progress.start()
        last_seen = start - 1
        try:
            idle_deadline = time.monotonic() + 30
            while last_seen < end - 1:
                msg = self.consumer.poll(0.5)
                if msg is None:
                    if time.monotonic() > idle_deadline:
                        raise TimeoutError(f"{topic}[{partition}]: nothing read for 30 s at offset "
                                           f"{last_seen + 1} (scanning up to {end})")
                    continue
                idle_deadline = time.monotonic() + 30
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        break
                    raise RuntimeError(f"reading {topic}[{partition}]: {err}")
                if msg.offset() >= end:
                    break
                last_seen = msg.offset()
                read += 1
                ts_type, ts = msg.timestamp()
                record = Record(topic, partition, msg.offset(), ts if ts_type else None, msg.key(),
                                msg.value(), tuple(msg.headers() or ()))
                if match is None or match(record):
                    out.append(record)
                self.progress.update(f"scanning {topic}[{partition}] offsets {start}..{end - 1}: "
                                     f"at {last_seen} ({(last_seen - start + 1) * 100 // (end - start)}%), "
                                     f"{len(out)} found")
        finally:
            self.consumer.unassign()
        return out, read

    def close(self) -> None:
        self.consumer.close()
