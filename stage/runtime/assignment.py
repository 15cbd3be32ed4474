"""Partitions coming and going: cooperative assign / revoke / lost, and the rewind after an
aborted transaction.

Assign creates a partition's state and starts its ledger load; revoke publishes what is
finished for it within the revoke budget, then drops its state; lost drops it at once (another
member may own it already); a rewind clears every partition's queues and reloads it from the
committed offsets. Uses: the consumer (assign, unassign, seek, committed offsets), the probe,
the ledger loads, the finalize and publish steps (revoke drains and publishes), the stats.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaException, TopicPartition

from stage.runtime import exits
from stage.runtime.pauses import HALTED

logger = logging.getLogger("stage.runtime.loop")


class Assignment:
    def __init__(self, cfg, *, partition_count, partitions, pauses, loads, finalization, publish,
                 clients, stats, fatal, declare_fatal) -> None:
        self.cfg = cfg
        self.topics = (cfg.topics.receipts, cfg.topics.staged_calls)
        self.partition_count = partition_count   # () -> the partition count checked at start
        self.partitions = partitions
        self.pauses = pauses
        self.loads = loads
        self.finalization = finalization
        self.publish = publish                   # (force) -> None: the runtime's publish step
        self.clients = clients
        self.stats = stats
        self.fatal = fatal                       # () -> the StageExit that stops the stage, or None
        self.declare_fatal = declare_fatal       # (StageExit) -> None

    # -- rebalance callbacks ---------------------------------------------------------------
    def on_assign(self, consumer, partitions) -> None:
        self.stats.inc("rebalances", kind="assign")
        new = sorted(tp.partition for tp in partitions)
        beyond = [p for p in new if p >= self.partition_count()]
        if beyond and self.fatal() is None:
            self.declare_fatal(repartitioned(self.cfg.topics.receipts, self.partition_count(),
                                             max(beyond) + 1))
        for p in new:
            self.loads.start(p)
        staged = [TopicPartition(self.cfg.topics.staged_calls, p) for p in new]
        consumer.incremental_assign(list(partitions) + staged)
        self.pauses.apply(consumer, self.partitions.numbers())  # loading partitions fetch nothing yet
        self._track()
        logger.info("assigned partitions %s (now holding %s); loading their ledgers", new,
                    self.partitions.numbers())

    def on_revoke(self, consumer, partitions) -> None:
        """Cooperative revoke: publish what is finished for these partitions within the budget
        (the new owner re-reads the rest from the committed offsets), then let them go."""
        self.stats.inc("rebalances", kind="revoke")
        revoked = {tp.partition for tp in partitions}
        before = self.stats.total("groups_published")
        if self.fatal() is None:   # after a fatal error nothing more is published: just let go
            self.finalization.drain(self.cfg.revoke_budget_ms / 1000, only=revoked)
            self.publish(force=True)
        left = sum(s.open_groups for s in self.partitions if s.number in revoked)
        self.drop(revoked)
        consumer.incremental_unassign(list(partitions) + [
            TopicPartition(self.cfg.topics.staged_calls, p) for p in revoked])
        logger.info("revoked partitions %s: published %d finished groups first, %d open groups left "
                    "to the next owner; now holding %s", sorted(revoked),
                    self.stats.total("groups_published") - before, left, self.partitions.numbers())

    def on_lost(self, consumer, partitions) -> None:
        """Lost partitions may already be owned by another member: publish nothing for them."""
        self.stats.inc("rebalances", kind="lost")
        lost = {tp.partition for tp in partitions}
        self.drop(lost)
        consumer.incremental_unassign(list(partitions) + [
            TopicPartition(self.cfg.topics.staged_calls, p) for p in lost])
        logger.warning("lost partitions %s (session timed out or fenced): their unpublished work is "
                       "dropped, the new owner re-reads it; now holding %s", sorted(lost),
                       self.partitions.numbers())

    def drop(self, numbers: set[int]) -> None:
        """Forget the partitions: their state, and their entries in the consumer-level services
        (registered with ``Partitions.on_drop``). Late results of theirs are discarded by epoch."""
        self.partitions.drop(numbers)
        self._track()
        self.stats.set("halted_partitions", sum(1 for s in self.partitions if s.halted is not None))

    def _track(self) -> None:
        if self.clients.probe is not None:
            self.clients.probe.track([(t, p) for p in self.partitions.numbers() for t in self.topics])
        self.stats.set("assigned_partitions", 2 * len(self.partitions))

    # -- rewind ----------------------------------------------------------------------------
    def rewind(self) -> None:
        """After an aborted transaction: forget all derived state and re-read from the committed
        offsets of every assigned partition (the ledger is reloaded too)."""
        consumer, numbers = self.clients.consumer, self.partitions.numbers()
        for state in self.partitions:
            state.clear_queues()
            state.halted = None
        tps = [TopicPartition(t, p) for p in numbers for t in self.topics]
        committed = self._committed_offsets(tps) if tps else []
        for p in numbers:
            self.pauses.release(p, HALTED)
            self.loads.start(p)
        self.pauses.apply(consumer, numbers)
        for tp in committed:
            if tp.offset < 0:
                low, _ = consumer.get_watermark_offsets(tp, timeout=10)
                tp = TopicPartition(tp.topic, tp.partition, low)
            self.clients.probe.invalidate(tp.topic, tp.partition)
            try:
                consumer.seek(tp)
            except KafkaException as e:
                logger.warning("seek %s[%d] to %d failed: %s", tp.topic, tp.partition, tp.offset, e)

    def _committed_offsets(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        """committed(), retried while the broker reports offsets held by an open transaction
        (a dead producer's transaction stays open until transaction.timeout.ms)."""
        deadline = time.monotonic() + self.cfg.transaction_timeout_ms / 1000 + 15
        while True:
            try:
                return self.clients.consumer.committed(tps, timeout=10)
            except KafkaException as e:
                if time.monotonic() > deadline:
                    raise
                logger.warning("committed offsets not available yet (%s); retrying", e.args[0])
                time.sleep(0.5)


def repartitioned(topic: str, expected: int, found: int) -> exits.StageExit:
    return exits.StageExit(exits.EXIT_TOPOLOGY, (
        f"topic {topic} now has {found} partitions, not {expected}: partitions were added while "
        "the stage was running. Group ids map to partitions by their count, so receipts and "
        "staged calls of one group would now land in different partitions and never meet. The "
        "stage stopped without committing past unpublished groups. Stop the producers, let the "
        "stage drain the old layout, then give every co-partitioned topic the same new count "
        "(`rollout-reassembler topics check` shows the layout) before restarting."))
