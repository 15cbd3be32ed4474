"""Why each input partition is paused.

librdkafka keeps one pause flag per topic-partition; the stage has several independent reasons
to stop fetching one (back-pressure, a ledger still loading, a schema-registry outage, a halted
partition, shutdown). A co-partitioned pair (receipts p + staged calls p) is fetched only when
no reason holds for p, and resuming for one reason never undoes another.

The reasons of an assigned partition are its own (``PartitionState.paused_for``, adopted here
when the partition is assigned); this object also remembers which partitions it has paused in
the consumer, which is consumer state and is forgotten when the partition leaves.
"""

from __future__ import annotations

from confluent_kafka import TopicPartition

BACKPRESSURE = "backpressure"   # buffer caps reached
LOADING = "loading"             # the partition's ledger is not loaded yet
REGISTRY = "registry"           # a record waits for a schema the registry cannot serve yet
HALTED = "halted"               # finalization failed in a way that would fail every group
SHUTDOWN = "shutdown"


class PauseSet:
    def __init__(self, topics: tuple[str, ...]) -> None:
        self.topics = topics
        self.reasons: dict[int, set[str]] = {}
        self._applied: set[int] = set()   # partitions paused in the consumer right now

    def adopt(self, partition: int, reasons: set[str]) -> None:
        """Track ``reasons`` (the partition's own set) as the reasons ``partition`` is held."""
        self.reasons[partition] = reasons

    def hold(self, partition: int, reason: str) -> None:
        self.reasons.setdefault(partition, set()).add(reason)

    def release(self, partition: int, reason: str) -> None:
        held = self.reasons.get(partition)
        if held is not None:
            held.discard(reason)

    def release_everywhere(self, reason: str) -> None:
        for held in self.reasons.values():
            held.discard(reason)

    def forget(self, partitions) -> None:
        """The partitions left the assignment: librdkafka dropped their pause flags too."""
        for p in partitions:
            self.reasons.pop(p, None)
            self._applied.discard(p)

    def why(self, partition: int) -> set[str]:
        return set(self.reasons.get(partition, ()))

    def paused(self, partition: int) -> bool:
        return bool(self.reasons.get(partition))

    def holding(self, reason: str) -> list[int]:
        return sorted(p for p, held in self.reasons.items() if reason in held)

    def apply(self, consumer, assigned) -> None:
        """Pause what newly has a reason, resume what has none left (assigned partitions only)."""
        want = {p for p in assigned if self.reasons.get(p)}
        to_pause, to_resume = want - self._applied, (self._applied & set(assigned)) - want
        if to_pause:
            consumer.pause(self._tps(to_pause))
        if to_resume:
            consumer.resume(self._tps(to_resume))
        self._applied = (self._applied - to_resume) | to_pause

    def _tps(self, partitions) -> list[TopicPartition]:
        return [TopicPartition(t, p) for p in sorted(partitions) for t in self.topics]

    @property
    def paused_count(self) -> int:
        return len(self._applied)
