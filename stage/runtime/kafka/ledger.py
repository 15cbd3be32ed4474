"""Reload the ledger partition of a newly assigned input partition.

The ledger (compacted, co-partitioned, written in the same transactions as the outputs) lists
groups published ahead of the committed input offsets, and, under one reserved key per
partition, the highest input offsets already dead-lettered. Their records will be re-read
after a restart or rebalance and must be skipped, not published (or dead-lettered) again.

The load waits while a transaction is open on the ledger partition (its last stable offset is
below its log end): a replica paused inside a transaction past its session timeout (a VM
pause, CPU throttling) may still commit it once it resumes. Loading without its entries would
publish its groups a second time; waiting for it to commit or abort (at most the transaction
timeout) keeps every group exactly once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from stage.publish.deadletters import DEAD_LETTER_WATERMARK_KEY
from stage.wire import INPUT_LEDGER_FIELDS
from stage.runtime.kafka.clients import reader_config
from stage.config.model import StageConfig

logger = logging.getLogger(__name__)


class LoadCancelled(RuntimeError):
    """The partition was revoked or the stage is stopping."""


@dataclass
class LedgerState:
    groups: dict[str, dict] = field(default_factory=dict)         # group_id -> LedgerEntry
    dead_letter_offsets: dict[str, int] = field(default_factory=dict)   # input role -> offset


def _end_offset(reader: Consumer, tp: TopicPartition) -> int:
    """The partition's end as ``reader`` sees it: the last stable offset for a read_committed
    reader, the log end (high watermark) for a read_uncommitted one."""
    return reader.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=10, cached=False)[1]


def wait_until_stable(committed: Consumer, uncommitted: Consumer, tp: TopicPartition, *,
                      timeout_s: float, should_stop, poll_s: float = 0.25) -> int:
    """Wait until no transaction that was open when we looked can still add entries: the last
    stable offset reaches the log end seen at the start. Returns that log end."""
    log_end = _retry(lambda: _end_offset(uncommitted, tp), should_stop)
    deadline = time.monotonic() + timeout_s
    next_log = time.monotonic() + 5
    while True:
        stable = _retry(lambda: _end_offset(committed, tp), should_stop)
        if stable >= log_end:
            return log_end
        if time.monotonic() > deadline:
            raise TimeoutError(f"ledger partition {tp.partition} still holds a transaction open "
                               f"after {timeout_s:.0f}s (stable offset {stable} < log end {log_end})")
        if time.monotonic() >= next_log:
            logger.warning("ledger partition %d: a transaction is open (stable offset %d < log end %d), "
                           "probably from a replica that stalled while publishing; waiting for it to "
                           "commit or abort before loading", tp.partition, stable, log_end)
            next_log = time.monotonic() + 10
        if should_stop():
            raise LoadCancelled()
        time.sleep(poll_s)


def _retry(fn, should_stop, attempts: int = 50):
    """Retriable errors (leader elections right after topic creation or a broker restart)."""
    for attempt in range(attempts):
        if should_stop():
            raise LoadCancelled()
        try:
            return fn()
        except KafkaException as e:
            if not e.args[0].retriable() or attempt + 1 == attempts:
                raise
            time.sleep(0.2)


def load_ledger(cfg: StageConfig, codec, partition: int, *, should_stop=lambda: False,
                timeout_s: float = 60.0) -> LedgerState:
    """The partition's ledger as of a point where no transaction on it is open, read_committed."""
    tp = TopicPartition(cfg.topics.stage_ledger, partition, OFFSET_BEGINNING)
    reader = Consumer(reader_config(cfg, "ledger-reader"))
    uncommitted = Consumer({**reader_config(cfg, "ledger-reader"), "isolation.level": "read_uncommitted"})
    try:
        high = wait_until_stable(reader, uncommitted, tp, timeout_s=cfg.transaction_timeout_ms / 1000 + 30,
                                 should_stop=should_stop)
        return _read(reader, tp, high, codec, should_stop, timeout_s)
    finally:
        uncommitted.close()
        reader.close()


def _read(reader: Consumer, tp: TopicPartition, high: int, codec, should_stop, timeout_s: float) -> LedgerState:
    state = LedgerState()
    if high <= 0:
        return state
    reader.assign([tp])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if should_stop():
            raise LoadCancelled()
        msg = reader.poll(0.5)
        if msg is None:
            continue
        if msg.error():
            if msg.error().code() == KafkaError._PARTITION_EOF:
                if msg.offset() >= high:
                    return state
                continue
            raise RuntimeError(f"ledger read failed: {msg.error()}")
        _apply(state, msg, codec)
        if msg.offset() + 1 >= high:
            return state
    raise TimeoutError(f"ledger partition {tp.partition} not read within {timeout_s}s")


def _apply(state: LedgerState, msg, codec) -> None:
    key = msg.key() or b""
    if key == DEAD_LETTER_WATERMARK_KEY:
        if msg.value() is not None:
            entry = codec.decode(msg.value())
            # an entry from before a role had its field (max_route_offset): -1
            state.dead_letter_offsets = {role: entry.get(field, -1) for role, field in INPUT_LEDGER_FIELDS.items()}
        return
    group_id = key.decode("utf-8", "replace")
    if msg.value() is None:
        state.groups.pop(group_id, None)
    else:
        state.groups[group_id] = codec.decode(msg.value())
