"""Exactly-once's offset commit under KIP-848 (group_protocol consumer), on a real broker:
the transaction carries the consumer's group metadata with its member epoch. A batch whose
metadata was taken before the member's assignment changed (another replica joined) is refused
by the group coordinator as a stale generation, which the stage's publisher must classify as
abortable (abort, re-read from the committed offsets): never a fatal stop, never a commit of
offsets under an old epoch. The same commit with fresh metadata goes through, and the offsets
of the co-assigned staged-calls partitions (not subscribed: assigned by the stage) commit with
the receipts' ones."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from stage.config.model import StageConfig
from stage.publish.transaction import Batch, PublishAborted, TransactionalPublisher
from stage.runtime.kafka.clients import consumer_config

PARTITIONS = 4


class Member:
    def __init__(self, bootstrap: str, group: str, name: str, lead: str, along: str) -> None:
        cfg = StageConfig(bootstrap_servers=bootstrap, group_id=group, group_protocol="consumer",
                          transactional_id=name)
        self.consumer = Consumer(consumer_config(cfg))
        self.owned: set[int] = set()
        pairs = lambda parts: list(parts) + [TopicPartition(along, tp.partition) for tp in parts]  # noqa: E731

        def assign(consumer, parts):
            consumer.incremental_assign(pairs(parts))
            self.owned |= {tp.partition for tp in parts}

        def revoke(consumer, parts):
            consumer.incremental_unassign(pairs(parts))
            self.owned -= {tp.partition for tp in parts}
        self.consumer.subscribe([lead], on_assign=assign, on_revoke=revoke, on_lost=revoke)

    def poll_until(self, predicate, timeout: float, *others) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "the group did not settle"
            self.consumer.poll(0.1)
            for other in others:
                other.consumer.poll(0.1)


def test_a_stale_member_epoch_aborts_the_transaction_and_a_fresh_one_commits(kip848_broker):
    bootstrap = kip848_broker.bootstrap
    run = uuid.uuid4().hex[:8]
    lead, along, out, group = f"r-{run}", f"s-{run}", f"o-{run}", f"g-{run}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in (lead, along, out)]).values():
        future.result()
    a = Member(bootstrap, group, f"a-{run}", lead, along)
    a.poll_until(lambda: a.owned == set(range(PARTITIONS)), 60)
    stale = a.consumer.consumer_group_metadata()
    b = Member(bootstrap, group, f"b-{run}", lead, along)
    a.poll_until(lambda: b.owned and not (a.owned & b.owned) and a.owned | b.owned == set(range(PARTITIONS)), 60, b)

    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{run}"})
    publisher = TransactionalPublisher(producer, timeout_s=20)
    publisher.start()
    kept = sorted(a.owned)
    offsets = [TopicPartition(t, p, 1) for t in (lead, along) for p in kept]
    record = (out, 0, b"k", b"v", None)
    with pytest.raises(PublishAborted, match="generation"):
        publisher.publish(Batch(records=[record], offsets=offsets, group_metadata=stale), a.consumer)
    assert publisher.aborted == 1 and publisher.committed == 0

    publisher.publish(Batch(records=[record], offsets=offsets,
                            group_metadata=a.consumer.consumer_group_metadata()), a.consumer)
    assert publisher.committed == 1
    committed = a.consumer.committed([TopicPartition(t, p) for t in (lead, along) for p in kept], timeout=20)
    assert {(tp.topic, tp.partition): tp.offset for tp in committed} == {(t, p): 1 for t in (lead, along) for p in kept}
    # only the committed transaction's record is visible to a read_committed reader
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{run}", "isolation.level": "read_committed",
                       "auto.offset.reset": "earliest", "enable.auto.commit": False})
    reader.assign([TopicPartition(out, 0, 0)])
    seen, deadline = [], time.monotonic() + 20
    while time.monotonic() < deadline and len(seen) < 1:
        msg = reader.poll(0.2)
        if msg is not None and not msg.error():
            seen.append(msg.value())
    time.sleep(0.5)
    while (msg := reader.poll(0.2)) is not None:
        if not msg.error():
            seen.append(msg.value())
    assert seen == [b"v"]
    for closing in (reader, a.consumer, b.consumer):
        closing.close()
    publisher.close()
