"""The intake step: one consumed record -> decoded, routing-checked, buffered; or put back (its
schema is not resolved yet, its partition is still loading); or dead-lettered once.

Owns: which topic-partitions were put back during the current consume batch.
Touches, of the record's partition: its buffer (a staged call admitted while the stage holds
its memory cap is spilled to disk there), its dead-letter watermarks, its dead-letter queue, its
REGISTRY pause and ``offsets_moved``. Uses: the codecs, the input limits, the consumer (to seek
back), the probe (a put-back record invalidates its partition's answer), the schema resolver and
``room`` (bytes left under max_buffered_bytes, asked once a batch). A failed seek asks
``rewind`` to start every partition over.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException, TopicPartition

from stage.buffer import ADDED, CONFLICT, Position
from stage.decode import (
    DECODED_OVERHEAD_BYTES,
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

# What a spilled staged call still holds in memory: its decoded small fields.
SPILLED_ITEM_BYTES = DECODED_OVERHEAD_BYTES


class Intake:
    def __init__(self, *, topics, codecs, limits, keep_routes, partition_count, partitions, pauses,
                 resolver, clients, stats, rewind, room=None) -> None:
        self.topics = topics                    # TopicNames
        self.codecs = codecs
        self.limits = limits
        # Route payloads are held only where finalization reads them (direct router replay);
        # otherwise they are checked at decode and released (stage.decode.staged).
        self.keep_routes = keep_routes
        self.partition_count = partition_count  # () -> the input topics' partition count
        self.partitions = partitions
        self.pauses = pauses
        self.resolver = resolver                # SchemaResolver, or None without a registry
        self.clients = clients
        self.stats = stats
        self.rewind = rewind
        self.room = room or (lambda: 1 << 62)   # () -> bytes left under the memory cap
        self.blocked: set[tuple[str, int]] = set()   # put back during this consume batch
        self._room = 1 << 62                  # room left as of this batch's start, less what it admitted

    def batch(self, messages, now_ms: int) -> None:
        self.blocked.clear()
        self._room = self.room()
        for msg in messages:
            self.record(msg, now_ms)

    def record(self, msg, now_ms: int) -> None:
        err = msg.error()
        if err is not None:
            if err.fatal():
                raise exits.kafka_fatal(f"consumer: {err}")
            logger.warning("consumer error: %s", err)
            return
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        if (topic, partition) in self.blocked:
            return  # after a record of this partition was put back: re-fetched from there
        state = self.partitions.get(partition)
        if state is not None and state.loading:
            self._put_back(msg)
            return
        if state is None or state.buffer is None:
            return  # revoked while the message was in flight
        buffer = state.buffer
        ts_type, ts = msg.timestamp()
        position = Position(topic, partition, offset, ts if ts_type and ts > 0 else now_ms)
        value = msg.value()
        receipts = topic == self.topics.receipts
        codec = self.codecs["ReceiptEvent" if receipts else "StagedCall"]
        try:
            if value is None:
                raise DecodeError("the record has no value (a tombstone); input records carry one")
            record = codec.decode(value, fetch=False)
            if receipts:
                item = receipt_item(record, position, len(value), self.limits)
            else:
                item = staged_item(record, position, len(value), self.limits, keep_routes=self.keep_routes)
            check_routing(msg.key(), item.group_id, partition, self.partition_count())
        except SchemaNotCached as pending:   # not consumed: read again once the id is resolved
            self._put_back(msg)
            self.pauses.hold(partition, REGISTRY)
            self.resolver.request(codec, pending.schema_id, partition)
            return
        except MisroutedError as error:
            self._reject(msg, state, position, error, MISROUTED)
            return
        except WireError as error:
            self._reject(msg, state, position, error, UNDECODABLE)
            return
        except (DecodeError, ValueError, KeyError, TypeError) as error:
            self._reject(msg, state, position, error,
                         UNDECODABLE if value is None else INVALID)
            return
        self.stats.inc("records_consumed", topic=topic)
        outcome = buffer.add_receipt(item, now_ms) if receipts else buffer.add_staged(item, now_ms)
        if outcome == ADDED:
            # Over the cap the input cannot always be paused (stage.runtime.backpressure): a
            # staged call that would pass it goes to disk, its small fields stay.
            if not receipts and self._room < item.nbytes and buffer.spill_staged(item, value, SPILLED_ITEM_BYTES):
                self.stats.inc("records_spilled")
            self._room -= item.nbytes
        if outcome == CONFLICT:  # well-formed but contradicts its group: keep it, visibly
            self._reject(msg, state, position, DecodeError(buffer.last_conflict), CONFLICT_CLASS,
                         buffered=False)
        if outcome != ADDED:
            self.stats.inc("records_skipped", topic=topic, reason=outcome)
            state.offsets_moved = True

    def _put_back(self, msg) -> None:
        """Unread ``msg`` (and the rest of its partition in this batch): fetched again later."""
        tp = TopicPartition(msg.topic(), msg.partition(), msg.offset())
        self.blocked.add((tp.topic, tp.partition))
        if self.clients.probe is not None:
            self.clients.probe.invalidate(tp.topic, tp.partition)
        try:
            self.clients.consumer.seek(tp)
        except KafkaException as error:  # not expected for an assigned partition: start over
            logger.error("seek %s[%d] to %d failed (%s); rewinding to the committed offsets",
                         tp.topic, tp.partition, tp.offset, error)
            self.rewind()

    def _reject(self, msg, state, position: Position, error: Exception, error_class: str, *,
                buffered: bool = True) -> None:
        """Dead-letter a record once: after a restart, records at or below the partition's
        dead-letter watermark (from the ledger) were dead-lettered already. ``buffered=False``:
        the buffer took the record (a conflict) and counted it already."""
        topic, offset = position.topic, position.offset
        if buffered:
            self.stats.inc("records_consumed", topic=topic)
            state.buffer.skip(topic, offset, position.timestamp_ms)
        marks = state.dead_letter_marks
        if offset <= marks.get(topic, -1):
            self.stats.inc("records_skipped", topic=topic, reason=DEAD_LETTERED_BEFORE)
            state.offsets_moved = True
            return
        marks[topic] = offset
        text = f"{type(error).__name__}: {error}"
        state.dead_letters.append((self.partitions.stamp(), DeadLetter(
            topic, state.number, offset, msg.key(), msg.value(), list(msg.headers() or []), text,
            error_class)))
        self.stats.inc("dead_letters", topic=topic, reason=error_class)
        logger.warning("dead-lettered %s[%d]@%d (%s): %s", topic, state.number, offset, error_class, error)

    # -- schema registry -------------------------------------------------------------------
    def resolve_schemas(self) -> None:
        """Partitions whose pending schema ids were resolved fetch again."""
        if self.resolver is None:
            return
        for partition in self.resolver.poll():
            self.pauses.release(partition, REGISTRY)
