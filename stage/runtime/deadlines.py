"""The loop's deadline step: which groups are ready (complete, or past a deadline whose input
partitions were read to their end as the brokers say), and deadlines held while an input
partition does not answer. Part of StageRuntime (stage.runtime.loop)."""

from __future__ import annotations

import logging
import time

from confluent_kafka import TopicPartition

from stage.runtime.pauses import HALTED, LOADING, REGISTRY

logger = logging.getLogger("stage.runtime.loop")

_NOT_FETCHING = frozenset({LOADING, REGISTRY, HALTED})   # a partition held for these is not "read"


class DeadlineSteps:
    # -- readiness and deadlines -----------------------------------------------------------
    def _take_ready(self, now_ms: int) -> None:
        due = {}
        for partition, buffer in self.buffers.items():
            deadline = buffer.next_deadline_ms()
            if partition not in self.halted and deadline is not None and deadline <= now_ms:
                due[partition] = deadline
        self.probe.poll(urgent={(t, p): d for p, d in due.items() for t in self.topics})
        positions = self._positions(due) if due else {}
        held = {}
        for partition, buffer in self.buffers.items():
            if partition in self.halted:
                continue
            read_to_end, force_before = {}, None
            if partition in due:
                not_fetching = self.pauses.why(partition) & _NOT_FETCHING
                for topic in self.topics:
                    read_to_end[topic] = -1 if not_fetching else self.probe.note_position(
                        topic, partition, positions.get((topic, partition), -1))
                unavailable = [t for t in self.topics if not self.probe.available(t, partition)]
                if unavailable and not not_fetching:
                    held[partition] = ", ".join(
                        f"{t}[{partition}] ({self.probe.why_unavailable(t, partition)})"
                        for t in unavailable)
                    if now_ms - due[partition] >= self.cfg.deadline_hold_max_ms:
                        force_before = now_ms - self.cfg.deadline_hold_max_ms
            ready, orphans = buffer.take_ready(now_ms, read_to_end, force_before_ms=force_before)
            if force_before is not None and (ready or orphans):
                self.stats.inc("deadlines_forced", len(ready) + len(orphans))
                logger.warning("partition %d: %d deadlines fired after waiting %.0fs for an unavailable "
                               "input partition (%s)", partition, len(ready) + len(orphans),
                               self.cfg.deadline_hold_max_ms / 1000, held.get(partition))
            for group, why in ready:
                self.waiting.append((group, why, self.epochs[partition]))
                self.stats.observe("group_fill_seconds", max(0.0, (now_ms - group.first_timestamp_ms) / 1000))
            if orphans:
                self.stats.inc("orphan_groups_expired", len(orphans))
                self.stats.inc("orphan_staged_expired", sum(len(g.staged) for g in orphans))
                self._offsets_dirty = True
        for partition in set(held) - set(self.held):
            logger.warning("deadlines of partition %d wait: input %s unavailable; they fire when it "
                           "answers again, or after deadline_hold_max_ms=%d", partition, held[partition],
                           self.cfg.deadline_hold_max_ms)
        for partition in set(self.held) - set(held):
            logger.info("deadlines of partition %d no longer wait for an unavailable input", partition)
        self.held = held
        self.stats.set("deadline_held_partitions", len(held))

    def _positions(self, partitions) -> dict[tuple[str, int], int]:
        """Where the consumer is in each input partition. Before the first record of an
        assignment librdkafka reports no position: the fetch started at the committed offset
        (or at the log start when none is committed)."""
        tps = [TopicPartition(t, p) for p in partitions for t in self.topics]
        out = {}
        for tp in self.consumer.position(tps):
            key = (tp.topic, tp.partition)
            out[key] = tp.offset if tp.offset >= 0 else self._start_offset(tp)
        return out

    def _start_offset(self, tp: TopicPartition) -> int:
        return self.start_offsets.get(tp.topic, tp.partition, time.monotonic())
