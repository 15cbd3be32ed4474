"""Trainer-side reader: canonical rows -> complete groups -> NeMo RL's padded training tensors.

``CanonicalReader`` consumes ``rollouts.canonical-rows`` (and, in deferred router replay,
``rollouts.route-plans``) read_committed, hands every record to a ``GroupAssembler`` (no Kafka:
joins by group id, de-duplicates by sample id) and hands out each group once all of its N rows
(and plans) are in::

    reader = CanonicalReader("broker:9092", group_id="trainer", device="cuda")
    for group in reader:                      # TrainingGroup, rows in row_index order
        batch = group.tensors()               # input_ids [N, max_len], token_mask, ... on cuda
        train_step(batch)
        reader.commit()                       # group-member mode: offsets of handed-out groups

A trainer that checkpoints saves ``reader.position()`` with its train state and restarts with
``start_from=`` that position (``stage.client.position``); ``staleness=`` drops or holds groups
too old for the current policy (``stage.client.staleness``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from stage.client.assembly import (
    GroupAssembler,
    TrainingGroup,
    route_plan_from_record,
    row_from_record,
)
from stage.client.connection import DEFAULT_CONNECT_TIMEOUT_S, reach
from stage.client.consuming import (
    DEFAULT_MAX_RECORD_BYTES,
    ClientLog,
    UnreadableRecord,
    codec_for,
    oversize_error,
    reader_defaults,
    retrying,
    take,
)
from stage.client.position import ReadPosition
from stage.client.route_fetch import DeferredRouteFetcher
from stage.client.staleness import Staleness
from stage.client.stream import DEFAULT_MAX_PENDING_RECORDS, DEFAULT_REMEMBER_RECORDS, GroupStream
from stage.wire import TopicNames, WireError

logger = logging.getLogger(__name__)


class CanonicalReader:
    """Complete groups from the canonical-rows topic (and route plans with ``route_plans``).

    How it joins Kafka:
    - no ``group_id``: assigns itself every partition, from ``start_from`` or the beginning;
      commits nothing (replay, evaluation, the demo);
    - ``group_id`` (``subscribe`` defaults to True): joins that consumer group (trainer replicas
      share the partitions); starts from the group's committed offsets, and ``commit()`` stores
      per partition the lowest offset a group not yet handed out still needs;
    - ``group_id`` with ``subscribe=False``: assigns itself every partition, from ``start_from``
      or the group's committed offsets, and ``commit()`` stores offsets under ``group_id`` for
      lag monitoring only. This is the checkpointing trainer's mode: its checkpoint, not the
      consumer group, says where to resume.

    ``position()`` is the checkpointable position (``ReadPosition``: ``to_dict``/``from_dict``):
    a reader started from it hands out exactly the groups not handed out before it.
    ``staleness`` (``Staleness``) is checked when a group is handed out, against the version
    last given to ``set_weight_version``. ``max_pending_records``: an incomplete group whose
    first record is this many records behind its partition's read position is given up
    (logged, counted ``abandoned``) so that it cannot hold the position back forever; a group's
    rows are published in one transaction, so only broken input leaves one incomplete that long.
    ``remember_records``: the position also names the groups handed out within this many
    records below its offsets, so a copy published again later (an at-least-once stage) is
    dropped after a restart too.

    ``max_record_bytes``: the stage's ``max_record_bytes`` (default: the stage's default, 8,000,000).
    Every limit of the reader follows it: the decode cap of each record and librdkafka's fetch
    limits (``config`` can still override single properties). A record the reader cannot decode,
    or a complete group whose rows' tensors cannot be built, stops it: ``UnreadableRecord`` is
    raised, now and on every later read, and the position never moves past the record (a
    checkpointing trainer restarts from before it once the cause is fixed).

    ``connect_timeout``: the reader asks the cluster for its metadata when it is created, at
    most this long; ``BrokerUnreachable`` (one line naming the address) when no broker answers.
    """

    def __init__(self, bootstrap_servers: str, *, topics: TopicNames | None = None,
                 group_id: str | None = None, route_plans: bool = False, device="cpu",
                 config: Mapping[str, Any] | None = None, framing: str = "plain",
                 schema_registry_url: str | None = None,
                 schema_registry_config: Mapping[str, Any] | None = None, subscribe: bool | None = None,
                 start_from: ReadPosition | Mapping | None = None, staleness: Staleness | None = None,
                 max_pending_records: int = DEFAULT_MAX_PENDING_RECORDS,
                 remember_records: int = DEFAULT_REMEMBER_RECORDS,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        self.topics = topics or TopicNames()
        self.max_record_bytes = int(max_record_bytes)
        self.codecs = {self.topics.canonical_rows: ("rows", codec_for(
            "CanonicalRow", self.topics.canonical_rows, framing, schema_registry_url, self.max_record_bytes,
            schema_registry_config))}
        if route_plans:
            self.codecs[self.topics.route_plans] = ("plans", codec_for(
                "RoutePlan", self.topics.route_plans, framing, schema_registry_url, self.max_record_bytes,
                schema_registry_config))
        self.group_id = group_id
        self.subscribed = group_id is not None if subscribe is None else subscribe
        if self.subscribed and group_id is None:
            raise ValueError("subscribe=True needs a group_id")
        if isinstance(start_from, Mapping):
            start_from = ReadPosition.from_dict(start_from)
        if start_from is not None and self.subscribed:
            raise ValueError("start_from needs a reader that assigns its partitions (no group_id, or "
                             "subscribe=False): in a consumer group partitions move between trainer "
                             "replicas, whose checkpoints would then disagree about them")
        self.stream = GroupStream(with_plans=route_plans, device=device, staleness=staleness,
                                  max_pending_records=max_pending_records,
                                  remember_records=remember_records)
        self.stopped: UnreadableRecord | None = None   # set once: every later read raises it
        self._log = ClientLog()      # librdkafka's lines; it only logs a fetch too large to receive
        conf = {**reader_defaults(bootstrap_servers, group_id or f"canonical-reader-{uuid.uuid4().hex}",
                                  self.max_record_bytes), "logger": self._log, **(config or {})}
        self._conf = conf
        self.consumer = Consumer(conf)
        metadata = reach(self.consumer, bootstrap_servers, "CanonicalReader", connect_timeout)
        names = list(self.codecs)
        if self.subscribed:
            self.consumer.subscribe(names, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                    on_lost=self._on_revoke)
        else:
            self._assign_all(names, start_from, metadata)

    # -- partitions --------------------------------------------------------------------------
    def _assign_all(self, names: list[str], start: ReadPosition | None, metadata) -> None:
        tps = []
        for name in names:
            topic = metadata.topics.get(name)
            if topic is None or topic.error is not None:
                raise RuntimeError(f"topic {name} does not exist")
            tps += [(name, p) for p in sorted(topic.partitions)]
        if start is not None:
            unknown = sorted(set(start.offsets()) - set(tps))
            if unknown:
                raise ValueError(f"the start position names partitions this reader does not read: "
                                 f"{unknown} (other topics or route_plans setting?)")
            self.stream.restore(start)
            offsets = start.offsets()
            self._check_kept(offsets)
        elif self.group_id is not None:  # continue where the group's commits say
            committed = retrying(lambda: self.consumer.committed(
                [TopicPartition(t, p) for t, p in tps], timeout=30))
            offsets = {(c.topic, c.partition): c.offset if c.offset >= 0 else None for c in committed}
        else:
            offsets = {}
        assignment = []
        for tp in tps:
            offset = offsets.get(tp)
            self.stream.assigned(tp, offset)
            assignment.append(TopicPartition(*tp, OFFSET_BEGINNING if offset is None else offset))
        self.consumer.assign(assignment)

    def _check_kept(self, offsets) -> None:
        """Say so when the topic no longer holds what the position needs: records deleted by
        retention since the checkpoint (their groups are lost to this trainer), or a position
        past the end (the topic was recreated: the reader starts over at its beginning)."""
        for (topic, partition), offset in offsets.items():
            if offset is None:
                continue
            low, high = retrying(lambda: self.consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=30))
            if offset < low:
                self.counts["lost_to_retention"] += low - offset
                logger.error("%s[%d]: the start position is at offset %d but the topic keeps records "
                             "from %d on: %d records were deleted (retention) before this trainer read "
                             "them", topic, partition, offset, low, low - offset)
            elif offset > high:
                self.counts["position_past_end"] += 1
                logger.error("%s[%d]: the start position (offset %d) is past the end (%d): was the topic "
                             "recreated? Reading from its beginning", topic, partition, offset, high)

    def _on_assign(self, consumer, partitions) -> None:
        for tp in partitions:
            self.stream.assigned((tp.topic, tp.partition), None)

    def _on_revoke(self, consumer, partitions) -> None:
        """Revoked partitions are re-read by their next owner from the committed offsets: forget
        everything read from them (and never commit for them again)."""
        self.stream.forget({(tp.topic, tp.partition) for tp in partitions})

    # -- reading -----------------------------------------------------------------------------
    @property
    def assembler(self) -> GroupAssembler:
        return self.stream.assembler

    @property
    def counts(self) -> Counter:
        return self.stream.counts

    @property
    def staleness(self) -> Staleness | None:
        return self.stream.staleness

    @property
    def held(self) -> list[TrainingGroup]:
        """Stale groups set aside (``on_stale="hold"``), not handed out yet."""
        return self.stream.held

    def set_weight_version(self, version: int) -> None:
        """The policy's current weight version (staleness is checked against it)."""
        self.stream.weight_version = int(version)

    def _fill(self, timeout: float, max_records: int) -> None:
        """Consume what is available (waiting at most ``timeout``) into the stream; stop at a
        record that cannot be read (UnreadableRecord), never past it."""
        if self.stopped is not None:
            raise self.stopped
        messages = take(self.consumer, max_records, timeout)
        for i, msg in enumerate(messages):
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    if err.fatal():
                        raise RuntimeError(f"consumer error: {err}")
                    logger.warning("canonical reader: %s", err)
                continue
            topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            kind, codec = self.codecs[topic]
            value = msg.value()
            try:
                record = codec.decode(value)
            except WireError as error:
                self._stop(UnreadableRecord(f"{kind} record", topic, partition, offset, error,
                                            self.max_record_bytes), messages[i:])
            self.stream.offer(kind, (topic, partition), offset, record, value)
        unusable = self.stream.end_batch()
        if unusable is not None:
            group_id, (topic, partition, offset), error = unusable
            self._stop(UnreadableRecord(f"group {group_id} (its rows' tensors), first record", topic,
                                        partition, offset, error, self.max_record_bytes), [])
        if self._log.oversize is not None:
            self._stop(self._oversize(*self._log.oversize), [])

    def _oversize(self, response_bytes: int, receive_limit: int) -> UnreadableRecord:
        """A fetch response librdkafka could not receive: the record is in one of the partitions
        not read to their end (a fetch asks for several at once), named by the first of them.
        Their ends are asked by a client of their own: the reader's connection is dropped by
        every such response."""
        assignment = self.consumer.assignment()
        self.consumer.pause(assignment)
        ends = Consumer(self._conf)
        behind = []
        try:
            for tp in assignment:
                nxt = self.stream.tracker.next.get((tp.topic, tp.partition))
                try:
                    low, high = retrying(lambda: ends.get_watermark_offsets(tp, timeout=5), timeout=15)
                except KafkaException:       # unknown: name it only if it was being read
                    low, high = (nxt or 0), (nxt or 0) + (nxt is not None)
                start = low if nxt is None else nxt
                if start < high:
                    behind.append((tp.topic, tp.partition, start))
        finally:
            ends.close()
        behind.sort()
        topic, partition, offset = behind[0] if behind else (self.topics.canonical_rows, -1, -1)
        others = "".join(f", or in {t}[{p}] from @{o}" for t, p, o in behind[1:])
        return UnreadableRecord(f"the first unread record (or one after it{others})", topic, partition,
                                offset, oversize_error(response_bytes, receive_limit, self.max_record_bytes),
                                self.max_record_bytes)

    def _stop(self, error: UnreadableRecord, unread: list) -> None:
        """Stop for good at ``error``: the messages not offered yet are fetched again from where
        they are (so nothing after the record is consumed past either), and every later read
        raises the same error."""
        logger.error("canonical reader stopped: %s", error)
        first: dict[tuple[str, int], int] = {}
        for msg in unread:
            if msg.error() is None:
                first.setdefault((msg.topic(), msg.partition()), msg.offset())
        for (topic, partition), offset in first.items():
            try:
                self.consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException as seek_error:   # the error stays sticky regardless
                logger.warning("seek %s[%d] to %d failed: %s", topic, partition, offset, seek_error)
        self.stopped = error
        raise error

    def poll(self, timeout: float = 1.0, max_records: int = 500) -> list[TrainingGroup]:
        """Consume what is available (waiting at most ``timeout``); hand out every complete
        group that passes the staleness check."""
        self._fill(0.0 if self.stream.ready else timeout, max_records)
        out = []
        while (group := self.stream.next_group()) is not None:
            out.append(group)
        return out

    def read(self, groups: int, *, timeout: float = 60.0) -> list[TrainingGroup]:
        """Hand out up to ``groups`` complete groups, polling for at most ``timeout`` seconds."""
        out: list[TrainingGroup] = []
        deadline = time.monotonic() + timeout
        while True:
            while len(out) < groups and (group := self.stream.next_group()) is not None:
                out.append(group)
            if len(out) >= groups or time.monotonic() >= deadline:
                return out
            self._fill(min(0.5, max(0.0, deadline - time.monotonic())), 500)

    def __iter__(self) -> Iterator[TrainingGroup]:
        """Every group, one at a time: a group counts as handed out once it is yielded."""
        while True:
            while (group := self.stream.next_group()) is not None:
                yield group
            self._fill(1.0, 500)

    def take_held(self) -> list[TrainingGroup]:
        """The stale groups set aside (``on_stale="hold"``); they count as handed out now."""
        return self.stream.take_held()

    # -- positions ---------------------------------------------------------------------------
    def position(self) -> ReadPosition:
        """Where a reader must start to hand out exactly the groups this one has not handed out
        yet (held and not yet yielded groups included). Save it with the train state that
        includes every group handed out so far."""
        return self.stream.position()

    def committable(self) -> list[TopicPartition]:
        """Per read partition: the lowest offset a group not handed out still needs, else the
        next offset (partitions not read yet are left out)."""
        return [TopicPartition(t, p, o) for (t, p), o in sorted(self.stream.resume_offsets().items())
                if o is not None]

    def commit(self) -> None:
        """Commit the committable offsets under ``group_id``."""
        if self.group_id is None:
            raise RuntimeError("commit() needs a group_id (readers without one commit nothing)")
        offsets = self.committable()
        if offsets:
            retrying(lambda: self.consumer.commit(offsets=offsets, asynchronous=False))

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> "CanonicalReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [  # the assembly and route-fetch names stay importable from here too
    "CanonicalReader", "DeferredRouteFetcher", "GroupAssembler", "ReadPosition", "Staleness",
    "TrainingGroup", "UnreadableRecord", "route_plan_from_record", "row_from_record",
]
