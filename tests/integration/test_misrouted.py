"""Misrouted input never joins a group: a record whose key is not its group_id, or that sits in
another partition than the contract's partitioner gives for its key, is dead-lettered as
``misrouted: ...``, counted, and the group publishes once, from its correctly routed records."""

from confluent_kafka import Producer

from stage.wire import AvroCodec
from stage.wire.partitioner import partition_for
from tests.integration.harness import (
    Feeder, RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics,
)

SUMMARY = AvroCodec("GroupSummary")
PARTITIONS = 4


def test_wrong_keys_and_partitions_are_dead_lettered_and_never_make_groups(kafka):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=3000)
    setup_topics(cfg, partitions=PARTITIONS)
    feed = Feeder(kafka.bootstrap, topics)
    spec = make_group("mr", 3, seed=90)
    home = partition_for(b"mr", PARTITIONS)
    codec = feed.receipt_codec
    feed.staged(spec)
    feed.receipts(spec, spec.receipts[1:])
    # A producer that keyed by rollout id: right partition, wrong key.
    feed.producer.produce(topics.receipts, key=b"mr-r0", partition=home, value=codec.encode(spec.receipts[0]))
    # The right key in the wrong partition.
    feed.producer.produce(topics.receipts, key=b"mr", partition=(home + 1) % PARTITIONS,
                          value=codec.encode(spec.receipts[0]))
    # A record naming another group under this group's key: would make a phantom group.
    phantom = dict(spec.receipts[0], group_id="phantom")
    feed.producer.produce(topics.receipts, key=b"mr", partition=home, value=codec.encode(phantom))
    # No key at all.
    feed.producer.produce(topics.receipts, key=None, partition=home, value=codec.encode(spec.receipts[0]))
    feed.flush()
    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("groups_published") >= 1 and stats.total("dead_letters") >= 4, 60,
                   "publication and dead letters")
        assert stats.count("dead_letters", topic=topics.receipts, reason="misrouted") == 4
    letters = read_all(kafka.bootstrap, topics.dead_letter, expect=4)
    errors = sorted(dict(m.headers())["error"].decode() for m in letters)
    assert all("misrouted: " in e for e in errors) and all(dict(m.headers())["error-class"] == b"misrouted"
                                                           for m in letters)
    assert any("key 'mr-r0' is not the record's group_id 'mr'" in e for e in errors)
    assert any(f"belongs in partition {home} of {PARTITIONS}" in e for e in errors)
    assert any("group_id 'phantom'" in e for e in errors)
    assert any("has no key" in e for e in errors)
    summaries = [SUMMARY.decode(m.value()) for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    assert [s["group_id"] for s in summaries] == ["mr"]            # once, and no phantom group
    (summary,) = summaries
    assert [r["reason"] for r in summary["rejections"]] == ["missing_receipt"]   # row 0 never arrived


def test_a_producer_using_librdkafkas_default_partitioner_is_caught(kafka):
    """crc32 (librdkafka's default) and murmur2 disagree for many keys: every receipt that landed
    elsewhere is a misrouted dead letter, not a silent missing_staging_row at the deadline."""
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=3000)
    setup_topics(cfg, partitions=PARTITIONS)
    feed = Feeder(kafka.bootstrap, topics)
    crc = Producer({"bootstrap.servers": kafka.bootstrap})      # partitioner: consistent_random
    specs = [make_group(f"crc{i}", 1, seed=91 + i, routes=None) for i in range(8)]
    placed = {}
    for spec in specs:
        feed.staged(spec)
        for value in spec.receipts:
            crc.produce(topics.receipts, key=spec.group_id.encode(), value=feed.receipt_codec.encode(value),
                        on_delivery=lambda err, msg: placed.__setitem__(msg.key().decode(), msg.partition()))
    feed.flush()
    assert crc.flush(30) == 0
    wrong = {g for g, p in placed.items() if p != partition_for(g.encode(), PARTITIONS)}
    assert wrong, "every key happened to agree: pick other group ids"
    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("groups_published") >= len(specs) - len(wrong)
                   and stats.total("dead_letters") >= len(wrong), 60, "publication")
        assert stats.count("dead_letters", topic=topics.receipts, reason="misrouted") == len(wrong)
    published = {SUMMARY.decode(m.value())["group_id"]
                 for m in read_all(kafka.bootstrap, topics.finalized_groups)}
    assert published == {s.group_id for s in specs} - wrong
