"""Reload the ledger partition of a newly assigned input partition.

The ledger (compacted, co-partitioned, written in the same transactions as the outputs) lists
groups published ahead of the committed input offsets. Their records will be re-read after a
restart or rebalance and must be skipped, not published again.
"""

from __future__ import annotations

import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from stage.runtime.clients import reader_config
from stage.runtime.config import StageConfig


def _watermarks(reader: Consumer, tp: TopicPartition, timeout_s: float) -> tuple[int, int]:
    """get_watermark_offsets, retried through leader elections (NOT_LEADER_FOR_PARTITION right
    after topic creation or a broker restart)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return reader.get_watermark_offsets(tp, timeout=10)
        except KafkaException as e:
            if not e.args[0].retriable() or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def load_ledger(cfg: StageConfig, codec, partition: int, timeout_s: float = 30.0) -> dict[str, dict]:
    """group_id -> latest LedgerEntry dict (tombstoned groups removed), read_committed."""
    reader = Consumer(reader_config(cfg, "ledger-reader"))
    try:
        tp = TopicPartition(cfg.topics.stage_ledger, partition, OFFSET_BEGINNING)
        low, high = _watermarks(reader, tp, timeout_s)
        entries: dict[str, dict] = {}
        if high <= low:
            return entries
        reader.assign([tp])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = reader.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    return entries
                raise RuntimeError(f"ledger read failed: {msg.error()}")
            key = (msg.key() or b"").decode("utf-8", "replace")
            if msg.value() is None:
                entries.pop(key, None)
            else:
                entries[key] = codec.decode(msg.value())
            if msg.offset() + 1 >= high:
                return entries
        raise TimeoutError(f"ledger partition {partition} not read within {timeout_s}s")
    finally:
        reader.close()
