"""Partitions coming and going, as the consumer sees them: cooperative assign / revoke / lost
of the lead input topic with every other input's same partition alongside, and the seek back
to the committed offsets of a rewind.

The runtime orchestrates a rebalance (stage.runtime.loop): on assign it adds each partition's
state (``add``) and starts its ledger load, then calls ``assign``; on revoke it lets the finalize and
publish steps finish what they can for the partitions within the revoke budget, then calls
``unassign`` and has every step forget them; on loss it does the same without publishing.
Owns: nothing. Writes: the assigned set (``Partitions``: add and drop). Uses: the consumer,
the probe (what it tracks, and the answers a seek makes stale), the stats.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaException, TopicPartition

from stage.runtime import exits
from stage.runtime.state.inputs import alongside, input_kinds, input_topics

logger = logging.getLogger("stage.runtime.loop")


class Assignment:
    def __init__(self, cfg, *, partitions, clients, stats) -> None:
        self.cfg = cfg
        kinds = input_kinds(cfg)
        self.topics = input_topics(cfg.topics, kinds)
        self.alongside = alongside(cfg.topics, kinds)
        self.partitions = partitions
        self.clients = clients                   # consumer and probe, read at call time
        self.stats = stats

    def add(self, partitions) -> list[int]:
        """The lead topic's newly assigned partitions, each with a fresh state (to be loaded
        before ``assign``)."""
        new = sorted(tp.partition for tp in partitions)
        for p in new:
            self.partitions.add(p)
        return new

    def assign(self, consumer, partitions) -> None:
        """Fetch the new lead partitions and every other input's same partitions."""
        new = sorted(tp.partition for tp in partitions)
        consumer.incremental_assign(list(partitions) + self._alongside(new))
        self.track()

    def remove(self, consumer, partitions) -> set[int]:
        """Let the partitions go (revoked or lost): their state is dropped, the consumer
        unassigns every input's partition."""
        numbers = {tp.partition for tp in partitions}
        self.partitions.drop(numbers)
        consumer.incremental_unassign(list(partitions) + self._alongside(sorted(numbers)))
        self.track()
        return numbers

    def _alongside(self, numbers) -> list[TopicPartition]:
        return [TopicPartition(t, p) for p in numbers for t in self.alongside]

    def track(self) -> None:
        if self.clients.probe is not None:
            self.clients.probe.track([(t, p) for p in self.partitions.numbers() for t in self.topics])

    def seek_committed(self) -> None:
        """After an aborted transaction: every assigned input partition fetches again from
        its committed offset."""
        consumer, numbers = self.clients.consumer, self.partitions.numbers()
        tps = [TopicPartition(t, p) for p in numbers for t in self.topics]
        for tp in self._committed_offsets(tps) if tps else []:
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
