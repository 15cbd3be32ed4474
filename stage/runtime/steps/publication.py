"""The publish step: finalized outputs, dead letters and ledger tombstones -> one transaction at
a time (stage.runtime.steps.flight), with a ledger entry per group, the dead-letter watermark,
and the input offsets it covers.

Owns: the outputs, dead letters and tombstones waiting for a transaction (each a
``PartitionQueue``), the flight, and when offsets were last committed. Writes, of a partition:
``committed`` and its buffer's published groups (marked published, expired to tombstones).
Input offsets that moved without a group (skipped records, dead letters before the
mark, expired orphans) are handed to it by the steps that moved them (``offsets_moved``).
Uses: the consumer's group metadata (given at call time), the ledger codec, the clock, the
stats. An aborted transaction raises ``Rewind``; one that can never commit raises
a ``StageExit``.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import TopicPartition

from stage.publish import Batch, PublishAborted, StageFatal
from stage.publish.deadletters import DEAD_LETTER_WATERMARK_KEY, DeadLetter, watermark_entry
from stage.runtime import exits
from stage.runtime.state.inputs import input_kinds
from stage.runtime.state.queue import PartitionQueue
from stage.runtime.steps.outcomes import Rewind

logger = logging.getLogger("stage.runtime.loop")

_OFFSETS_ONLY_EVERY_S = 1.0   # a transaction carrying only moved offsets, at most this often


def output_bytes(out) -> int:
    """The encoded records of one finalized group (stage.publish.outputs.Outputs)."""
    return sum(len(value) for _topic, value in out.records if value) + len(out.ledger_value or b"")


class Publication:
    def __init__(self, cfg, *, flight, ledger_codec, clock, partitions, stats) -> None:
        self.cfg = cfg
        self.topics = cfg.topics
        self.kinds = input_kinds(cfg)          # the input table of this mode
        self.flight = flight
        self.ledger_codec = ledger_codec
        self.clock = clock
        self.partitions = partitions
        self.stats = stats
        self.done: PartitionQueue = PartitionQueue()          # finalized Outputs
        self.dead_letters: PartitionQueue[DeadLetter] = PartitionQueue()
        self.tombstones: PartitionQueue[tuple] = PartitionQueue()   # ledger records (value None)
        self._last_commit = time.monotonic()
        self._moved: set[int] = set()   # partitions whose input offsets moved with no output

    # -- what it is handed -----------------------------------------------------------------
    def offer(self, outputs: list) -> None:
        for out in outputs:
            self.done.put(out.partition, out)

    def offer_dead_letters(self, letters: list[DeadLetter]) -> None:
        for letter in letters:
            self.dead_letters.put(letter.source_partition, letter)

    def offsets_moved(self, partitions) -> None:
        """Records of these partitions were consumed that no output covers: commit them (in a
        transaction of their own at most every second)."""
        self._moved |= set(partitions)

    def forget(self, partitions) -> None:
        """The partitions left or are reloaded: what waits for them goes (the flight stays)."""
        partitions = set(partitions)
        for queue in (self.done, self.dead_letters, self.tombstones):
            queue.forget(partitions)
        self._moved -= partitions

    @property
    def queued(self) -> int:
        return len(self.done) + len(self.dead_letters) + len(self.tombstones)

    @property
    def in_flight(self) -> bool:
        return self.flight.in_flight

    @property
    def output_bytes(self) -> int:
        """Encoded outputs waiting for a transaction."""
        return sum(output_bytes(out) for out in self.done.items())

    @property
    def publishing_bytes(self) -> int:
        return self.flight.nbytes

    def stuck(self) -> str | None:
        return self.flight.stuck()

    def tell_outcomes(self, partitions) -> None:
        """Partitions whose ledger was just read again: say what happened to the groups of a
        transaction that a new producer cut short (in the ledger: it committed)."""
        for number in partitions:
            groups = self.flight.cut_short_of(number)
            state = self.partitions.get(number)
            if not groups or state is None or state.buffer is None:
                continue
            committed = sorted(g for g in groups if g in state.buffer.published)
            aborted = sorted(g for g in groups if g not in state.buffer.published)
            if committed:
                logger.warning("partition %d: the transaction cut short was committed: its groups %s "
                               "are in the ledger and are not published again", number, committed)
            if aborted:
                logger.warning("partition %d: the transaction cut short was aborted: its groups %s are "
                               "not in the ledger and are published again from the re-read input",
                               number, aborted)

    # -- the step --------------------------------------------------------------------------
    def publish(self, consumer, force: bool = False) -> None:
        """Keep one transaction in flight on the publisher thread while the loop goes on
        consuming and finalizing; apply its outcome when it completes. ``force``: publish
        everything finished now and wait (shutdown, revoke)."""
        flight = self.flight
        if force:
            flight.wait()
            flight.watch(forced=True)
            if flight.in_flight and not flight.settled:
                raise Rewind("the transaction in flight failed while its producer was being replaced")
        else:
            flight.watch()     # replacements: started, or finished (may raise Rewind)
        if flight.in_flight:
            if not flight.settled:
                return
            self._land(*flight.take(), consumer)
        while True:
            if not flight.can_launch:   # the brokers are unreachable, or a new producer is starting
                return
            batch = self._next_batch(consumer, force)
            if batch is None:
                return
            flight.launch(*batch, consumer)
            if not force:
                return
            flight.wait()
            self._land(*flight.take(), consumer)
            if not self.queued:
                return

    def _next_batch(self, consumer, force: bool):
        done = self.done.items()
        oldest = min((o.ready_at for o in done), default=None)
        now = time.monotonic()
        due = (force or len(done) >= self.cfg.publish_batch_groups or self.dead_letters
               or (oldest is not None and now - oldest >= self.cfg.publish_linger_ms / 1000)
               or (self._moved and now - self._last_commit >= _OFFSETS_ONLY_EVERY_S))
        if not due:
            return None
        outputs = self.done.take_oldest(self.cfg.publish_batch_groups)
        batch = Batch()
        for out in outputs:
            key = out.group_id.encode("utf-8")
            for topic, value in out.records:
                batch.records.append((topic, out.partition, key, value, None))
            batch.records.append((self.topics.stage_ledger, out.partition, key, out.ledger_value, None))
        dead_letters = self.dead_letters.take_oldest()
        batch.records.extend(dl.record(self.topics.dead_letter) for dl in dead_letters)
        batch.records.extend(self._watermark_records(dead_letters))
        batch.records.extend(self.tombstones.take_oldest())
        batch.offsets = self._committable({(o.partition, o.group_id) for o in outputs})
        batch.group_metadata = consumer.consumer_group_metadata()
        self._moved.clear()
        if not batch:
            return None
        return outputs, batch

    def _watermark_records(self, dead_letters: list[DeadLetter]) -> list:
        """The ledger entry that makes this transaction's dead letters exactly once: per
        partition, the marks carried by its latest dead letter."""
        latest = {}
        for letter in dead_letters:     # oldest first: the last one per partition wins
            latest[letter.source_partition] = letter.marks
        now = self.clock.now_ms()
        out = []
        for p, marks in sorted(latest.items()):
            entry = watermark_entry(p, {kind.role: marks.get(kind.topic(self.topics), -1) for kind in self.kinds}, now)
            out.append((self.topics.stage_ledger, p, DEAD_LETTER_WATERMARK_KEY,
                        self.ledger_codec.encode(entry), None))
        return out

    # -- a publication that came back ------------------------------------------------------
    def _land(self, future, outputs, batch, consumer) -> None:
        """Apply a finished publication: mark its groups published, or rewind after an abort."""
        try:
            seconds = future.result()
            self.flight.publisher.commit_offsets(batch, consumer)  # at-least-once only
        except PublishAborted as error:
            logger.warning("publication aborted (%s); rewinding to the committed offsets", error)
            self.stats.inc("transactions_aborted")
            raise Rewind(f"publication aborted: {error}") from None
        except StageFatal as error:
            text = str(error)
            if "fenced" in text.lower():
                raise exits.fenced(self.cfg.effective_transactional_id, text) from None
            raise exits.kafka_fatal(text) from None
        self.stats.inc("transactions_committed")
        self.stats.observe("publish_seconds", seconds)
        now = self.clock.now_ms()
        for out in outputs:
            state = self.partitions.get(out.partition)
            if state is not None and state.buffer is not None and out.group_id in state.buffer.groups:
                unreferenced = state.buffer.mark_published(out.group_id, now)
                if unreferenced:   # route chunks no staged call named, dropped with their group
                    self.stats.inc("records_skipped", unreferenced, topic=self.topics.staged_routes,
                                   reason="unreferenced")
            self.stats.inc("groups_published", outcome=out.outcome)
            self.stats.inc("rows_published", out.valid_rows, valid="true")
            self.stats.inc("rows_published", out.total_rows - out.valid_rows, valid="false")
            for reason in out.rejections:
                self.stats.inc("rejections", bucket=(reason or "unknown").split(":", 1)[0])
            self.stats.sink.group_metrics_observed(out.metrics)
            self.stats.observe("end_to_end_seconds",
                               max(0.0, (now - out.context.last_timestamp_ms) / 1000))
        self._remember_committed(batch.offsets)
        self._last_commit = time.monotonic()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("committed: groups %s, %d records, offsets %s", [o.group_id for o in outputs],
                         len(batch.records), {f"{tp.topic}[{tp.partition}]": tp.offset for tp in batch.offsets})

    def _committable(self, publishing: set) -> list[TopicPartition]:
        """Per input partition, the lowest offset still needed once this batch is published.
        Every known offset is sent, changed or not: the offset commit is what fences a replica
        that stalled past its session timeout (KIP-447 checks the group generation there), so
        no transaction may go without one."""
        offsets = []
        for state in self.partitions.loaded():
            excluding = {group_id for p, group_id in publishing if p == state.number}
            for kind in self.kinds:
                topic = kind.topic(self.topics)
                candidate = state.buffer.committable(topic, state.committed.get(topic), excluding=excluding)
                if candidate is not None:
                    offsets.append(TopicPartition(topic, state.number, candidate))
        return offsets

    def _remember_committed(self, offsets: list[TopicPartition]) -> None:
        for tp in offsets:
            state = self.partitions.get(tp.partition)
            if state is not None:
                state.committed[tp.topic] = tp.offset
        now = self.clock.now_ms()
        for state in self.partitions.loaded():
            for group_id in state.buffer.expire_published(state.committed, now):
                self.tombstones.put(state.number, (
                    self.topics.stage_ledger, state.number, group_id.encode("utf-8"), None, None))

    def committed_offsets(self) -> dict[str, int]:
        """``topic[partition]`` -> the offset this process last committed there (for logs)."""
        return {f"{topic}[{s.number}]": offset for s in self.partitions
                for topic, offset in sorted(s.committed.items())}
