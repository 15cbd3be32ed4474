"""The deadline step: which groups are ready (complete, or past a deadline whose input
partitions were read to their end as the brokers say), and deadlines held while an input
partition does not answer.

Owns: which partitions' deadlines are held, and why (``held``). Hands on: the groups it takes
as ``Ready`` work (for the finalize step) and the partitions whose expired orphans moved their
offsets (for the publication step). Writes, of every
loaded partition that is not halted: its buffer (takes ready groups, expires orphans). Reads
the pause reasons of this iteration. Uses: the probe, the consumer's positions and the start
offsets (clients), the stats.
"""

from __future__ import annotations

import logging
import time

from dataclasses import dataclass

from confluent_kafka import TopicPartition

from stage.buffer import GroupState
from stage.runtime.state.pauses import HALTED, LOADING, REGISTRY

logger = logging.getLogger("stage.runtime.loop")

_NOT_FETCHING = frozenset({LOADING, REGISTRY, HALTED})   # a partition held for these is not "read"


@dataclass(frozen=True, eq=False)
class Ready:
    """A group taken as ready, with the epoch of its partition when it was taken."""

    group: GroupState
    why: str          # complete or deadline
    epoch: int


class Deadlines:
    def __init__(self, *, topics: tuple[str, ...], hold_max_ms: int, partitions, clients,
                 stats) -> None:
        self.topics = topics            # the input topics (stage.runtime.state.inputs)
        self.hold_max_ms = hold_max_ms  # deadline_hold_max_ms
        self.partitions = partitions
        self.clients = clients          # probe, consumer and start offsets, read at call time
        self.stats = stats
        self.held: dict[int, str] = {}  # partition -> the unavailable input its deadlines wait for

    def forget(self, partitions) -> None:
        for p in partitions:
            self.held.pop(p, None)

    def take_ready(self, now_ms: int, reasons: dict[int, frozenset[str]]) -> tuple[list[Ready], set[int]]:
        """``reasons``: this iteration's pause reasons by partition (stage.runtime.state.pauses)."""
        probe = self.clients.probe
        taken: list[Ready] = []
        moved: set[int] = set()
        states = [s for s in self.partitions.loaded() if HALTED not in reasons.get(s.number, ())]
        due = {}
        for state in states:
            deadline = state.buffer.next_deadline_ms()
            if deadline is not None and deadline <= now_ms:
                due[state.number] = deadline
        probe.poll(urgent={(t, p): d for p, d in due.items() for t in self.topics})
        positions = self._positions(due) if due else {}
        newly_held, released = [], []
        for state in states:
            partition, held = state.number, None
            read_to_end, force_before = {}, None
            if partition in due:
                not_fetching = reasons.get(partition, frozenset()) & _NOT_FETCHING
                for topic in self.topics:
                    read_to_end[topic] = -1 if not_fetching else probe.note_position(
                        topic, partition, positions.get((topic, partition), -1))
                unavailable = [t for t in self.topics if not probe.available(t, partition)]
                if unavailable and not not_fetching:
                    held = ", ".join(f"{t}[{partition}] ({probe.why_unavailable(t, partition)})"
                                     for t in unavailable)
                    if now_ms - due[partition] >= self.hold_max_ms:
                        force_before = now_ms - self.hold_max_ms
            ready, orphans = state.buffer.take_ready(now_ms, read_to_end, force_before_ms=force_before)
            if force_before is not None and (ready or orphans):
                self.stats.inc("deadlines_forced", len(ready) + len(orphans))
                logger.warning("partition %d: %d deadlines fired after waiting %.0fs for an unavailable "
                               "input partition (%s)", partition, len(ready) + len(orphans),
                               self.hold_max_ms / 1000, held)
            for group, why in ready:
                taken.append(Ready(group, why, state.epoch))
                self.stats.observe("group_fill_seconds", max(0.0, (now_ms - group.first_timestamp_ms) / 1000))
            if orphans:
                self.stats.inc("orphan_groups_expired", len(orphans))
                self.stats.inc("orphan_staged_expired", sum(len(g.staged) for g in orphans))
                chunks = sum(len(g.chunks) for g in orphans)
                if chunks:   # direct router replay: route chunks of groups no receipt named
                    self.stats.inc("records_skipped", chunks, topic=state.buffer.routes_topic,
                                   reason="orphan_expired")
                moved.add(partition)
            self._note_held(state, held, newly_held, released)
        for state in self.partitions:   # halted or loading: nothing of theirs is due
            if state not in states:
                self._note_held(state, None, newly_held, released)
        for partition in newly_held:
            logger.warning("deadlines of partition %d wait: input %s unavailable; they fire when it "
                           "answers again, or after deadline_hold_max_ms=%d", partition,
                           self.held[partition], self.hold_max_ms)
        for partition in released:
            logger.info("deadlines of partition %d no longer wait for an unavailable input", partition)
        return taken, moved

    def _note_held(self, state, held: str | None, newly_held: list, released: list) -> None:
        before = self.held.get(state.number)
        if held is not None and before is None:
            newly_held.append(state.number)
        elif held is None and before is not None:
            released.append(state.number)
        if held is None:
            self.held.pop(state.number, None)
        else:
            self.held[state.number] = held

    def _positions(self, partitions) -> dict[tuple[str, int], int]:
        """Where the consumer is in each input partition. Before the first record of an
        assignment librdkafka reports no position: the fetch started at the committed offset
        (or at the log start when none is committed)."""
        tps = [TopicPartition(t, p) for p in partitions for t in self.topics]
        out = {}
        for tp in self.clients.consumer.position(tps):
            key = (tp.topic, tp.partition)
            out[key] = tp.offset if tp.offset >= 0 else self._start_offset(tp)
        return out

    def _start_offset(self, tp: TopicPartition) -> int:
        return self.clients.start_offsets.get(tp.topic, tp.partition, time.monotonic())
