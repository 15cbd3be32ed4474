"""A read_committed reader of the stage's outputs that runs during every fault (Jepsen's and
Kafka's transactions_test.py's concurrent consumer), and the checks on what it saw.

It reads the rows, route plans and summaries through the unfaulted listener, keeping every
record by (topic, partition, offset). At the end its view is compared with a read_committed and
a read_uncommitted read of the same topics:
- aborted read: a record it saw that a transaction aborted (in the read_uncommitted view only);
- lost after read: a record it saw that is not in the committed log any more (or differs);
- torn group: a group whose summary it saw without all of its N rows (or rows without the
  summary), or a row (sample id) seen twice.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, TopicPartition

from stage.wire import AvroCodec, TopicNames

ROWS = AvroCodec("CanonicalRow")
SUMMARY = AvroCodec("GroupSummary")


def _consumer(bootstrap: str, isolation: str) -> Consumer:
    return Consumer({"bootstrap.servers": bootstrap, "group.id": f"verify-{uuid.uuid4().hex}",
                     "auto.offset.reset": "earliest", "enable.auto.commit": False,
                     "isolation.level": isolation, "enable.partition.eof": True})


def _partitions(consumer: Consumer, topic: str, timeout: float = 30.0) -> list[int]:
    """The topic's partitions once the broker asked knows them all with a leader: a topic just
    created is known to the other brokers of a cluster a moment later, and an answer without it
    (no partitions) would leave the topic unread for the whole run."""
    deadline = time.monotonic() + timeout
    while True:
        meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if meta is not None and meta.error is None and meta.partitions and all(
                p.leader >= 0 for p in meta.partitions.values()):
            return sorted(meta.partitions)
        if time.monotonic() > deadline:
            raise AssertionError(f"no metadata with leaders for {topic} after {timeout}s: {meta and meta.error}")
        time.sleep(0.2)


def _assign_all(consumer: Consumer, topics: list[str]) -> int:
    parts = [TopicPartition(t, p, 0) for t in topics for p in _partitions(consumer, t)]
    consumer.assign(parts)
    return len(parts)


def snapshot(bootstrap: str, topics: list[str], isolation: str, timeout: float = 60.0) -> dict:
    """Every record of ``topics`` to their end: (topic, partition, offset) -> value."""
    consumer = _consumer(bootstrap, isolation)
    try:
        total, eof, out = _assign_all(consumer, topics), set(), {}
        deadline = time.monotonic() + timeout
        while len(eof) < total:
            if time.monotonic() > deadline:
                raise AssertionError(f"{isolation} snapshot of {topics} did not reach the end in {timeout}s")
            for msg in consumer.consume(1000, 0.5):
                key = (msg.topic(), msg.partition())
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        eof.add(key)
                        continue
                    raise AssertionError(f"{isolation} snapshot: {msg.error()}")
                eof.discard(key)
                out[(msg.topic(), msg.partition(), msg.offset())] = msg.value()
        return out
    finally:
        consumer.close()


@dataclass
class Verdict:
    seen: int = 0
    aborted_in_log: int = 0      # records the log holds from aborted transactions (faults did bite)
    aborted_reads: list = field(default_factory=list)
    lost_after_read: list = field(default_factory=list)
    torn: list = field(default_factory=list)
    seen_twice: list = field(default_factory=list)
    per_topic: dict = field(default_factory=dict)   # topic -> (seen, committed, uncommitted)

    @property
    def ok(self) -> bool:
        return not (self.aborted_reads or self.lost_after_read or self.torn or self.seen_twice)

    def counts(self) -> str:
        return (f"read {self.seen} committed records, {self.aborted_in_log} aborted ones in the log; "
                f"aborted reads {len(self.aborted_reads)}, lost after read {len(self.lost_after_read)}, "
                f"torn groups {len(self.torn)}, rows seen twice {len(self.seen_twice)}")

    def problems(self) -> str:
        return (f"aborted reads {self.aborted_reads[:5]}; lost after read {self.lost_after_read[:5]}; "
                f"torn {self.torn[:5]}; seen twice {self.seen_twice[:5]}; "
                f"records per topic (seen, committed, uncommitted): {self.per_topic}")


class Verifier:
    """``start`` on a thread; ``first_seen`` (group id -> wall time its summary became visible);
    ``verdict(n)`` after the run."""

    def __init__(self, bootstrap: str, topics: TopicNames) -> None:
        self.bootstrap = bootstrap
        self.topic_names = topics
        self.topics = [topics.canonical_rows, topics.route_plans, topics.finalized_groups]
        self.records: dict = {}
        self.first_seen: dict[str, float] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._consumer = _consumer(bootstrap, "read_committed")
        _assign_all(self._consumer, self.topics)
        self._thread = threading.Thread(target=self._run, daemon=True, name="verifier")
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for msg in self._consumer.consume(1000, 0.2):
                    if msg.error():
                        if msg.error().code() != KafkaError._PARTITION_EOF:
                            raise AssertionError(f"verifier: {msg.error()}")
                        continue
                    self.records[(msg.topic(), msg.partition(), msg.offset())] = msg.value()
                    if msg.topic() == self.topic_names.finalized_groups:
                        self.first_seen.setdefault(SUMMARY.decode(msg.value())["group_id"], time.time())
        except BaseException as error:  # noqa: BLE001 - surfaced by verdict()
            self.error = error

    def published(self) -> set[str]:
        return set(self.first_seen)

    def wait_caught_up(self, committed: dict, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not committed.keys() <= self.records.keys():
            if self.error:
                return
            if time.monotonic() > deadline:
                missing = sorted(committed.keys() - self.records.keys())
                raise AssertionError(f"the verifier did not read {len(missing)} committed records in "
                                     f"{timeout}s: {missing[:5]}")
            time.sleep(0.2)

    def verdict(self, n: int) -> Verdict:
        """After the last group is published: the checks in the module docstring (``n``: rows per group)."""
        committed = snapshot(self.bootstrap, self.topics, "read_committed")
        uncommitted = snapshot(self.bootstrap, self.topics, "read_uncommitted")
        self.wait_caught_up(committed)
        self.close()
        if self.error is not None:
            raise AssertionError(f"the verifier failed: {self.error!r}")
        seen = dict(self.records)
        aborted = uncommitted.keys() - committed.keys()
        v = Verdict(seen=len(seen), aborted_in_log=len(aborted))
        v.per_topic = {t.rsplit(".", 1)[-1]: tuple(sum(1 for k in view if k[0] == t)
                                                   for view in (seen, committed, uncommitted))
                       for t in self.topics}
        for key, value in seen.items():
            if key in aborted:
                v.aborted_reads.append(key)
            elif committed.get(key) != value:
                v.lost_after_read.append(key)
        rows: dict[str, Counter] = {}
        summaries: Counter = Counter()
        for (topic, _, _), value in seen.items():
            if topic == self.topic_names.canonical_rows:
                row = ROWS.decode(value)
                rows.setdefault(row["group_id"], Counter())[row["sample_id"]] += 1
            elif topic == self.topic_names.finalized_groups:
                summaries[SUMMARY.decode(value)["group_id"]] += 1
        v.seen_twice = [(g, s) for g, c in rows.items() for s, k in c.items() if k > 1]
        v.seen_twice += [(g, "summary") for g, k in summaries.items() if k > 1]
        for group in set(rows) | set(summaries):
            if summaries[group] != 1 or len(rows.get(group, ())) != n:
                v.torn.append((group, len(rows.get(group, ())), summaries[group]))
        return v

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        try:
            self._consumer.close()
        except RuntimeError:
            pass
