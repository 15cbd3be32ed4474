"""The intake step: one consumed record -> decoded, routing-checked, buffered; or put back (its
schema is not resolved yet, its partition is still loading); or dead-lettered once.

Owns: which topic-partitions were put back during the current consume batch, and the
partition count records are routed by (checked at start). Hands on: the dead letters it makes
and the partitions whose offsets moved with no output (skipped records: ``batch`` returns
both, for the publication step). Writes, of the record's partition: its
buffer (adds; a staged call or route chunk admitted over the memory cap is spilled to disk there) and its
dead-letter marks (through ``DeadLetterMarks.mark``). Uses: the input table
(stage.runtime.state.inputs), the codecs, the input limits, the consumer and the probe (a put
back record is sought back, and its partition's end-offset answer invalidated), the schema
resolver, and the budget's ``room`` (taken once a batch). A failed seek raises ``Rewind``.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from stage.buffer import ADDED, CONFLICT, Position
from stage.decode import DECODED_OVERHEAD_BYTES, DecodeError, MisroutedError, check_routing
from stage.publish.deadletters import CONFLICT as CONFLICT_CLASS
from stage.publish.deadletters import (
    DEAD_LETTERED_BEFORE,
    INVALID,
    MISROUTED,
    UNDECODABLE,
    DeadLetter,
)
from dataclasses import dataclass, field

from stage.runtime import exits
from stage.runtime.state.inputs import INPUTS, by_topic
from stage.runtime.steps.outcomes import Budget, ConsumerFenced, Rewind
from stage.wire import SchemaNotCached, WireError

logger = logging.getLogger("stage.runtime.loop")

# What a spilled staged call still holds in memory: its decoded small fields.
SPILLED_ITEM_BYTES = DECODED_OVERHEAD_BYTES


@dataclass
class Taken:
    """What one consume batch hands on to the publication step."""

    dead_letters: list[DeadLetter] = field(default_factory=list)
    moved: set[int] = field(default_factory=set)   # partitions with records no output will cover


class Intake:
    def __init__(self, *, topics, codecs, limits, keep_routes, partitions, resolver, clients,
                 stats, transactional_id: str = "", kinds=INPUTS) -> None:
        self.kinds = by_topic(topics, kinds)    # input topic -> its InputKind (the mode's table)
        self.codecs = codecs
        self.limits = limits
        self.keep_routes = keep_routes          # direct router replay reads route payloads
        self.partitions = partitions            # read: each record's PartitionState
        self.resolver = resolver                # SchemaResolver, or None without a registry
        self.clients = clients                  # consumer and probe, read at call time
        self.stats = stats
        self.transactional_id = transactional_id   # named when the consumer is fenced
        self.partition_count = 0                # of every input topic, checked at start
        self.blocked: set[tuple[str, int]] = set()   # put back during this consume batch
        self._room = 1 << 62                    # room left as of this batch's start (less the finalize
                                                # reserve), less what it admitted
        self._moved: set[int] = set()           # this batch's partitions with skipped records

    def batch(self, messages, now_ms: int, budget: Budget = Budget()) -> Taken:
        self.blocked.clear()
        self._room = budget.room - budget.reserve   # it spills rather than use the finalize reserve
        taken, self._moved = Taken(), set()
        for msg in messages:
            letter = self.record(msg, now_ms)
            if letter is not None:
                taken.dead_letters.append(letter)
        taken.moved, self._moved = self._moved, set()
        return taken

    def record(self, msg, now_ms: int) -> DeadLetter | None:
        """Take one consumed record; the dead letter it became, if it became one now."""
        err = msg.error()
        if err is not None:
            # librdkafka hands a fatal consumer error over as code _FATAL with fatal() false (the
            # cause only in its text): taken for a warning, it left a consumer that fetches
            # nothing more in a process that never exits (seen in the soak)
            fatal = err.fatal() or err.code() == KafkaError._FATAL
            if err.code() == KafkaError.FENCED_INSTANCE_ID or (fatal and "group.instance.id" in err.str()):
                raise ConsumerFenced(err.str())   # static membership: the id twice (the runtime decides)
            if fatal:
                raise exits.kafka_fatal(f"consumer: {err}")
            logger.warning("consumer error: %s", err)
            return None
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        if (topic, partition) in self.blocked:
            return None  # after a record of this partition was put back: re-fetched from there
        state = self.partitions.get(partition)
        if state is not None and state.loading:
            self._put_back(msg)
            return None
        if state is None or state.buffer is None:
            return None  # revoked while the message was in flight
        kind = self.kinds[topic]
        ts_type, ts = msg.timestamp()
        position = Position(topic, partition, offset, ts if ts_type and ts > 0 else now_ms)
        value = msg.value()
        codec = self.codecs[kind.record]
        try:
            if value is None:
                raise DecodeError("the record has no value (a tombstone); input records carry one")
            record = codec.decode(value, fetch=False)
            item = kind.item(record, position, len(value), self.limits, self.keep_routes)
            check_routing(msg.key(), item.group_id, partition, self.partition_count)
        except SchemaNotCached as pending:   # not consumed: read again once the id is resolved
            self._put_back(msg)
            self.resolver.request(codec, pending.schema_id, partition)
            return None
        except MisroutedError as error:
            return self._reject(msg, state, position, error, MISROUTED)
        except WireError as error:
            return self._reject(msg, state, position, error, UNDECODABLE)
        except (DecodeError, ValueError, KeyError, TypeError) as error:
            return self._reject(msg, state, position, error, UNDECODABLE if value is None else INVALID)
        self.stats.inc("records_consumed", topic=topic)
        buffer = state.buffer
        outcome = kind.add(buffer, item, now_ms)
        if outcome == ADDED:
            # Over the cap the input cannot always be paused (stage.runtime.steps.backpressure):
            # a record that would pass it goes to disk where its kind allows, its small fields stay.
            if kind.spills and self._room < item.nbytes and kind.spill(buffer, item, value):
                self.stats.inc("records_spilled")
            self._room -= item.nbytes
        letter = None
        if outcome == CONFLICT:  # well-formed but contradicts its group: keep it, visibly
            letter = self._reject(msg, state, position, DecodeError(buffer.last_conflict),
                                  CONFLICT_CLASS, buffered=False)
        if outcome != ADDED:
            self.stats.inc("records_skipped", topic=topic, reason=outcome)
            self._moved.add(partition)
        return letter

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
            raise Rewind(f"seek {tp.topic}[{tp.partition}] failed: {error}") from None

    def _reject(self, msg, state, position: Position, error: Exception, error_class: str, *,
                buffered: bool = True) -> DeadLetter | None:
        """Dead-letter a record once: after a restart, records at or below the partition's
        dead-letter mark (from the ledger) were dead-lettered already. ``buffered=False``:
        the buffer took the record (a conflict) and counted it already."""
        topic, offset = position.topic, position.offset
        if buffered:
            self.stats.inc("records_consumed", topic=topic)
            state.buffer.skip(topic, offset, position.timestamp_ms)
        if not state.dead_letter_marks.mark(topic, offset):
            self.stats.inc("records_skipped", topic=topic, reason=DEAD_LETTERED_BEFORE)
            self._moved.add(state.number)
            return None
        text = f"{type(error).__name__}: {error}"
        self.stats.inc("dead_letters", topic=topic, reason=error_class)
        logger.warning("dead-lettered %s[%d]@%d (%s): %s", topic, state.number, offset, error_class, error)
        return DeadLetter(topic, state.number, offset, msg.key(), msg.value(),
                          list(msg.headers() or []), text, error_class,
                          marks=state.dead_letter_marks.snapshot(), epoch=state.epoch)
