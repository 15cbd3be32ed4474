"""The loop's intake step: one consumed record -> decoded, routing-checked, buffered; or put
back (its schema is not resolved yet, its partition is still loading); or dead-lettered once.
Part of StageRuntime (stage.runtime.loop), which holds the state these methods use."""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException, TopicPartition

from stage.buffer import ADDED, CONFLICT, Position
from stage.decode import (
    DecodeError,
    MisroutedError,
    check_routing,
    receipt_item,
    staged_item,
)
from stage.publish.deadletters import CONFLICT as CONFLICT_CLASS
from stage.publish.deadletters import (
    DEAD_LETTERED_BEFORE,
    INVALID,
    MISROUTED,
    UNDECODABLE,
    DeadLetter,
)
from stage.runtime import exits
from stage.runtime.pauses import REGISTRY
from stage.wire import SchemaNotCached, WireError

logger = logging.getLogger("stage.runtime.loop")


class IntakeSteps:
    # -- intake ----------------------------------------------------------------------------
    def _intake(self, msg, now_ms: int) -> None:
        err = msg.error()
        if err is not None:
            if err.fatal():
                raise exits.kafka_fatal(f"consumer: {err}")
            logger.warning("consumer error: %s", err)
            return
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        if (topic, partition) in self._blocked:
            return  # after a record of this partition was put back: re-fetched from there
        if partition in self.loading:
            self._put_back(msg)
            return
        buffer = self.buffers.get(partition)
        if buffer is None:
            return  # revoked while the message was in flight
        ts_type, ts = msg.timestamp()
        position = Position(topic, partition, offset, ts if ts_type and ts > 0 else now_ms)
        value = msg.value()
        receipts = topic == self.cfg.topics.receipts
        codec = self.codecs["ReceiptEvent" if receipts else "StagedCall"]
        try:
            if value is None:
                raise DecodeError("the record has no value (a tombstone); input records carry one")
            record = codec.decode(value, fetch=False)
            make = receipt_item if receipts else staged_item
            item = make(record, position, len(value), self.limits)
            check_routing(msg.key(), item.group_id, partition, self.partitions)
        except SchemaNotCached as pending:   # not consumed: read again once the id is resolved
            self._put_back(msg)
            self.pauses.hold(partition, REGISTRY)
            self.resolver.request(codec, pending.schema_id, partition)
            return
        except MisroutedError as error:
            self._reject(msg, buffer, position, error, MISROUTED)
            return
        except WireError as error:
            self._reject(msg, buffer, position, error, UNDECODABLE)
            return
        except (DecodeError, ValueError, KeyError, TypeError) as error:
            self._reject(msg, buffer, position, error,
                         UNDECODABLE if value is None else INVALID)
            return
        self.stats.inc("records_consumed", topic=topic)
        outcome = buffer.add_receipt(item, now_ms) if receipts else buffer.add_staged(item, now_ms)
        if outcome == CONFLICT:  # well-formed but contradicts its group: keep it, visibly
            self._reject(msg, None, position, DecodeError(buffer.last_conflict), CONFLICT_CLASS)
        if outcome != ADDED:
            self.stats.inc("records_skipped", topic=topic, reason=outcome)
            self._offsets_dirty = True

    def _put_back(self, msg) -> None:
        """Unread ``msg`` (and the rest of its partition in this batch): fetched again later."""
        tp = TopicPartition(msg.topic(), msg.partition(), msg.offset())
        self._blocked.add((tp.topic, tp.partition))
        if self.probe is not None:
            self.probe.invalidate(tp.topic, tp.partition)
        try:
            self.consumer.seek(tp)
        except KafkaException as error:  # not expected for an assigned partition: start over
            logger.error("seek %s[%d] to %d failed (%s); rewinding to the committed offsets",
                         tp.topic, tp.partition, tp.offset, error)
            self._rewind()

    def _reject(self, msg, buffer, position: Position, error: Exception, error_class: str) -> None:
        """Dead-letter a record once: after a restart, records at or below the partition's
        dead-letter watermark (from the ledger) were dead-lettered already."""
        topic, partition, offset = position.topic, position.partition, position.offset
        if buffer is not None:   # (a conflict was counted when the buffer took it)
            self.stats.inc("records_consumed", topic=topic)
        if buffer is not None:
            buffer.skip(topic, offset, position.timestamp_ms)
        watermarks = self.dl_watermarks.setdefault(partition, {})
        if offset <= watermarks.get(topic, -1):
            self.stats.inc("records_skipped", topic=topic, reason=DEAD_LETTERED_BEFORE)
            self._offsets_dirty = True
            return
        watermarks[topic] = offset
        text = f"{type(error).__name__}: {error}"
        self.dead_letters.append(DeadLetter(topic, partition, offset, msg.key(), msg.value(),
                                            list(msg.headers() or []), text, error_class))
        self.stats.inc("dead_letters", topic=topic, reason=error_class)
        logger.warning("dead-lettered %s[%d]@%d (%s): %s", topic, partition, offset, error_class, error)

    # -- schema registry -------------------------------------------------------------------
    def _resolve_schemas(self) -> None:
        if self.resolver is None:
            return
        for partition in self.resolver.poll():
            self.pauses.release(partition, REGISTRY)
