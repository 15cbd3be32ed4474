"""The rebalance pause of each consumer group protocol, with the stage's consumer settings.

    PYTHONPATH=$PWD .venv/bin/python -m tests.faults.rebalance_bench [--rounds 2] [--partitions 8]

Two consumers built from ``consumer_config`` (the stage's settings: static membership, read
committed; cooperative-sticky under ``classic``, KIP-848 under ``consumer``) subscribe the
receipts topic and co-assign the staged-calls topic's same partitions in their callbacks, as the
stage does. A producer writes to every partition of both topics every 10 ms throughout. Measured
per protocol, rounds interleaved (classic, consumer, consumer, classic, ...) on one broker with
Kafka's defaults for both protocols (classic: librdkafka's 45 s session and 3 s heartbeat;
KIP-848: the brokers' 45 s session and 5 s heartbeat):

- join: from the second consumer's subscribe to every partition of both topics fetched again by
  its new owner (the slowest partition), and the longest gap in any partition's records;
- leave: the second consumer leaves as the stage does on SIGTERM (unsubscribe, serve the revoke,
  close); from the unsubscribe to every partition fetched again by the first consumer.

A member that dies (kill -9) waits out the session timeout under both protocols (45 s by
default): not measured here. docs/operations.md carries the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from stage.brokers.kraft import KraftBroker, jars_available
from stage.config.model import StageConfig
from stage.runtime.kafka.clients import consumer_config
from stage.bench.machine import machine_line


class Member:
    """One consumer, polled on its own thread; records when it last saw each (topic, partition)."""

    def __init__(self, conf: dict, lead: str, along: str, name: str) -> None:
        self.consumer = Consumer({**conf, "client.id": name, "log_level": 3})
        self.lead, self.along = lead, along
        self.last: dict[tuple[str, int], float] = {}
        self.first_after: dict[tuple[str, int], float] = {}
        self.mark = float("inf")
        self.owned: set[int] = set()
        self._stop = threading.Event()
        self._leave = threading.Event()
        self.left_at = None
        self.consumer.subscribe([lead], on_assign=self._assign, on_revoke=self._revoke, on_lost=self._revoke)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _pairs(self, parts) -> list[TopicPartition]:
        return list(parts) + [TopicPartition(self.along, tp.partition) for tp in parts]

    def _assign(self, consumer, parts) -> None:
        consumer.incremental_assign(self._pairs(parts))
        self.owned |= {tp.partition for tp in parts}

    def _revoke(self, consumer, parts) -> None:
        consumer.incremental_unassign(self._pairs(parts))
        self.owned -= {tp.partition for tp in parts}

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._leave.is_set():
                self.consumer.unsubscribe()
                deadline = time.monotonic() + 5
                while self.owned and time.monotonic() < deadline:
                    self.consumer.poll(0.05)
                self.consumer.poll(0.05)
                self.consumer.close()
                return
            msg = self.consumer.poll(0.05)
            if msg is None or msg.error():
                continue
            now = time.monotonic()
            key = (msg.topic(), msg.partition())
            self.last[key] = now
            if now >= self.mark and key not in self.first_after:
                self.first_after[key] = now

    def leave(self) -> None:
        self._leave.set()
        self.thread.join(15)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(15)
        try:
            self.consumer.close()
        except RuntimeError:
            pass          # closed by leave()


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def one_round(bootstrap: str, protocol: str, partitions: int) -> dict:
    run = uuid.uuid4().hex[:8]
    lead, along = f"receipts-{run}", f"staged-{run}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(t, partitions, 1) for t in (lead, along)]).values():
        future.result()
    def conf(name: str) -> dict:
        return consumer_config(StageConfig(bootstrap_servers=bootstrap, group_id=f"bench-{run}",
                                           group_protocol=protocol, transactional_id=f"{name}-{run}"))
    producing = threading.Event()
    producing.set()

    def produce() -> None:
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        while producing.is_set():
            for p in range(partitions):
                producer.produce(lead, b"r", partition=p)
                producer.produce(along, b"s", partition=p)
            producer.poll(0)
            time.sleep(0.01)
        producer.flush(10)

    writer = threading.Thread(target=produce, daemon=True)
    writer.start()
    every = {(t, p) for t in (lead, along) for p in range(partitions)}
    first = Member(conf("a"), lead, along, "a")
    second = None
    try:
        if not _wait(lambda: every <= set(first.last), 120):
            raise RuntimeError(f"{protocol}: the first member never fetched every partition")
        # join
        t0 = time.monotonic()
        first.mark = t0
        second = Member(conf("b"), lead, along, "b")
        second.mark = t0

        def settled() -> bool:
            moved = second.owned
            return bool(moved) and all((t, p) in second.first_after for t in (lead, along) for p in moved) \
                and not (first.owned & moved)
        if not _wait(settled, 120):
            raise RuntimeError(f"{protocol}: the second member never fetched its partitions")
        join = max(second.first_after[(t, p)] for t in (lead, along) for p in second.owned) - t0
        moved = set(second.owned)
        # leave
        time.sleep(1.0)
        first.first_after.clear()
        t1 = time.monotonic()
        first.mark = t1
        threading.Thread(target=second.leave, daemon=True).start()
        if not _wait(lambda: all((t, p) in first.first_after for t in (lead, along) for p in moved), 120):
            raise RuntimeError(f"{protocol}: the first member never took the partitions back")
        leave = max(first.first_after[(t, p)] for t in (lead, along) for p in moved) - t1
        return {"join": join, "leave": leave, "moved": len(moved)}
    finally:
        producing.clear()
        writer.join(15)
        first.stop()
        if second is not None:
            second.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds per protocol, interleaved")
    parser.add_argument("--partitions", type=int, default=8)
    args = parser.parse_args(argv)
    if not jars_available():
        print("Kafka jars not found (make kafka-jars)", file=sys.stderr)
        return 1
    order = []
    for i in range(args.rounds):
        order += ["classic", "consumer"] if i % 2 == 0 else ["consumer", "classic"]
    figures: dict[str, list[dict]] = {"classic": [], "consumer": []}
    print(machine_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="rebalance-bench-") as tmp:
        # Kafka's production default for a new group's first join (the test brokers use 0)
        broker = KraftBroker(tmp, props={"group.initial.rebalance.delay.ms": "3000"}).start()
        try:
            for protocol in order:
                result = one_round(broker.bootstrap, protocol, args.partitions)
                figures[protocol].append(result)
                print(f"{protocol:8s} join {result['join']:6.2f} s   leave {result['leave']:6.2f} s   "
                      f"({result['moved']} of {args.partitions} partitions moved)", flush=True)
        finally:
            broker.stop()
    print()
    for protocol, rows in figures.items():
        print(f"{protocol:8s} median join {statistics.median(r['join'] for r in rows):.2f} s, "
              f"median leave {statistics.median(r['leave'] for r in rows):.2f} s ({len(rows)} rounds)")
    anchor = statistics.median(r["join"] for r in figures["classic"])
    print(f"join ratio consumer/classic {statistics.median(r['join'] for r in figures['consumer']) / anchor:.2f}; "
          f"leave ratio {statistics.median(r['leave'] for r in figures['consumer']) / statistics.median(r['leave'] for r in figures['classic']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
