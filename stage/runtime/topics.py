"""Topic layout checks and creation. Every topic is keyed by group_id and co-partitioned: a
group's receipts, staged calls, outputs and ledger entry share one partition number."""

from __future__ import annotations

import time

from confluent_kafka import TopicCollection
from confluent_kafka.admin import AdminClient, NewTopic

from stage.runtime.config import StageConfig

# Topics whose partition counts must all be equal (the dead-letter topic is exempt).
COPARTITIONED = ("receipts", "staged_calls", "canonical_rows", "route_plans", "finalized_groups",
                 "stage_ledger")


class TopologyError(RuntimeError):
    pass


def partition_counts(admin: AdminClient, names: list[str], timeout: float = 10.0) -> dict[str, int | None]:
    metadata = admin.list_topics(timeout=timeout)
    out = {}
    for name in names:
        topic = metadata.topics.get(name)
        out[name] = None if topic is None or topic.error is not None else len(topic.partitions)
    return out


def check_copartitioning(admin: AdminClient, cfg: StageConfig) -> int:
    """Refuse to start unless every co-partitioned topic exists with the same partition count."""
    names = {role: getattr(cfg.topics, role) for role in COPARTITIONED}
    counts = partition_counts(admin, list(names.values()) + [cfg.topics.dead_letter])
    missing = [f"{role} ({name})" for role, name in names.items() if counts[name] is None]
    if counts[cfg.topics.dead_letter] is None:
        missing.append(f"dead_letter ({cfg.topics.dead_letter})")
    if missing:
        raise TopologyError("missing topics: " + ", ".join(missing)
                            + "; create them with `rollout-reassembler topics create`")
    distinct = {counts[name] for name in names.values()}
    if len(distinct) != 1:
        layout = ", ".join(f"{name}={counts[name]}" for name in names.values())
        raise TopologyError(
            "input, output and ledger topics must have the same number of partitions "
            f"(co-partitioned by group_id), got {layout}")
    return distinct.pop()


def topic_specs(cfg: StageConfig, partitions: int, replication: int, max_message_bytes: int) -> list[NewTopic]:
    big = {"max.message.bytes": str(max_message_bytes)}
    specs = [NewTopic(getattr(cfg.topics, role), partitions, replication,
                      config=({"cleanup.policy": "compact"} if role == "stage_ledger" else dict(big)))
             for role in COPARTITIONED]
    specs.append(NewTopic(cfg.topics.dead_letter, partitions, replication, config=dict(big)))
    return specs


def create_topics(admin: AdminClient, cfg: StageConfig, *, partitions: int, replication: int = 1,
                  max_message_bytes: int = 64 << 20, timeout: float = 30.0) -> list[str]:
    """Create whatever is missing; returns the names created. Existing topics are left alone."""
    existing = admin.list_topics(timeout=timeout).topics
    specs = [s for s in topic_specs(cfg, partitions, replication, max_message_bytes)
             if s.topic not in existing]
    if not specs:
        return []
    for future in admin.create_topics(specs, operation_timeout=timeout).values():
        future.result()
    _wait_visible(admin, [s.topic for s in specs], partitions, timeout)
    return [s.topic for s in specs]


def _wait_visible(admin: AdminClient, names: list[str], partitions: int, timeout: float) -> None:
    """Creation returns before every broker's metadata has the topics; a consumer assigned a
    partition it cannot see yet does not fetch it for a while, so wait until all have leaders."""
    deadline = time.monotonic() + timeout
    while True:
        topics = admin.list_topics(timeout=timeout).topics
        if all(n in topics and topics[n].error is None and len(topics[n].partitions) == partitions
               and all(p.leader >= 0 for p in topics[n].partitions.values()) for n in names):
            return
        if time.monotonic() > deadline:
            raise TopologyError(f"created topics not visible with leaders after {timeout}s: {names}")
        time.sleep(0.1)


class PartitionWatch:
    """Notices partitions added to an input topic while the stage runs (asynchronously: the
    admin client's futures, checked from the loop). ``poll()`` -> (topic, new count) or None."""

    def __init__(self, admin: AdminClient, topics, expected: int, interval_s: float) -> None:
        self.admin, self.topics, self.expected, self.interval_s = admin, tuple(topics), expected, interval_s
        self._next = time.monotonic() + interval_s
        self._futures: dict | None = None

    def poll(self) -> tuple[str, int] | None:
        if self._futures is not None:
            if not all(f.done() for f in self._futures.values()):
                return None
            futures, self._futures = self._futures, None
            for topic, future in futures.items():
                try:
                    count = len(future.result().partitions)
                except Exception:  # noqa: BLE001 - a failed lookup says nothing about the layout
                    continue
                if count != self.expected:
                    return topic, count
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + self.interval_s
            try:
                self._futures = self.admin.describe_topics(TopicCollection(list(self.topics)),
                                                           request_timeout=10)
            except Exception:  # noqa: BLE001 - retried at the next interval
                self._futures = None
        return None


def watch_partition_counts(admin: AdminClient, topics, expected: int, interval_s: float) -> PartitionWatch:
    return PartitionWatch(admin, topics, expected, interval_s)
