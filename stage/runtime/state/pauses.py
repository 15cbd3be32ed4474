"""Why each input partition is paused, derived from the state once an iteration.

librdkafka keeps one pause flag per topic-partition; the stage has several independent reasons
to stop fetching one (a ledger still loading, a record waiting for the schema registry, a
halted partition, back-pressure, shutdown). The reasons are not kept anywhere: each is read
from the step that owns its cause (``reasons_of``), and ``PauseSet`` pauses in the consumer
what newly has a reason and resumes what has none left. A co-partitioned set (every input
topic's partition p) is fetched only when no reason holds for p.
"""

from __future__ import annotations

import logging

from confluent_kafka import TopicPartition

logger = logging.getLogger("stage.runtime.loop")

BACKPRESSURE = "backpressure"   # buffer caps reached
LOADING = "loading"             # the partition's ledger is not loaded yet
REGISTRY = "registry"           # a record waits for a schema the registry cannot serve yet
HALTED = "halted"               # finalization failed in a way that would fail every group
SHUTDOWN = "shutdown"


def reasons_of(partitions, *, registry_pending=frozenset(), halted=frozenset(),
               backpressure: bool = False, stopping: bool = False) -> dict[int, frozenset[str]]:
    """Partition -> why it is not fetched, from who owns each cause: the partition's ledger
    load (its state), the schema resolver's pending partitions, the finalize step's halts,
    the back-pressure step, the runtime's shutdown."""
    out = {}
    for state in partitions:
        p, why = state.number, set()
        if state.loading:
            why.add(LOADING)
        if p in registry_pending:
            why.add(REGISTRY)
        if p in halted:
            why.add(HALTED)
        if backpressure:
            why.add(BACKPRESSURE)
        if stopping:
            why.add(SHUTDOWN)
        out[p] = frozenset(why)
    return out


class PauseSet:
    """The pause flags this process set in the consumer, and the reasons last applied."""

    def __init__(self, topics: tuple[str, ...]) -> None:
        self.topics = topics
        self.reasons: dict[int, frozenset[str]] = {}
        self._applied: set[int] = set()   # partitions paused in the consumer right now

    def apply(self, consumer, reasons: dict[int, frozenset[str]]) -> None:
        """Pause what newly has a reason, resume what has none left (``reasons`` covers every
        assigned partition; a partition not in it has left the assignment, and librdkafka
        dropped its flags)."""
        if reasons != self.reasons and logger.isEnabledFor(logging.DEBUG):
            logger.debug("pause reasons: %s", {p: sorted(why) for p, why in sorted(reasons.items())})
        self.reasons = dict(reasons)
        self._applied &= set(reasons)
        want = {p for p, why in reasons.items() if why}
        to_pause, to_resume = want - self._applied, self._applied - want
        if to_pause:
            consumer.pause(self._tps(to_pause))
        if to_resume:
            consumer.resume(self._tps(to_resume))
        self._applied = (self._applied - to_resume) | to_pause

    def why(self, partition: int) -> set[str]:
        return set(self.reasons.get(partition, ()))

    def holding(self, reason: str) -> list[int]:
        return sorted(p for p, why in self.reasons.items() if reason in why)

    def _tps(self, partitions) -> list[TopicPartition]:
        return [TopicPartition(t, p) for p in sorted(partitions) for t in self.topics]

    @property
    def paused_count(self) -> int:
        return len(self._applied)
