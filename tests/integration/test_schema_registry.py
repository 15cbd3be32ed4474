"""Schema Registry framing with a registry that goes down and comes back: good records wait
(nothing dead-lettered, nothing committed past them), the loop keeps polling, readiness and a
metric say why, SIGTERM works; only a schema id the registry says does not exist is a dead
letter."""

import signal
import time

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.client import StagingProducer
from stage.wire import AvroCodec
from tests.faults.procs import StageProcess
from tests.integration.harness import (
    Feeder, RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics,
)
from tests.support.registry import FakeRegistry

SUMMARY = AvroCodec("GroupSummary")


@pytest.fixture
def registry():
    server = FakeRegistry().start()
    yield server
    server.stop()


def _setup(kafka, registry, **overrides):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, framing="confluent", schema_registry_url=registry.url,
                       group_timeout_ms=600_000, **overrides)
    setup_topics(cfg, partitions=1)
    producer = StagingProducer(kafka.bootstrap, topics=topics, framing="confluent",
                               schema_registry_url=registry.url)
    for codec in producer.codecs.values():   # the producer registers while the registry is up
        codec.ensure_registered()
    return cfg, topics, producer


def _send(producer, spec) -> None:
    for value in spec.staged:
        producer.send_staged(spec.group_id, value)
    for value in spec.receipts:
        producer.send_receipt(spec.group_id, value)
    producer.flush()


def _committed(kafka, cfg) -> dict:
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    request = ConsumerGroupTopicPartitions(cfg.group_id, [TopicPartition(cfg.topics.receipts, 0),
                                                          TopicPartition(cfg.topics.staged_calls, 0)])
    result = admin.list_consumer_group_offsets([request])[cfg.group_id].result()
    return {tp.topic: tp.offset for tp in result.topic_partitions}


def test_a_registry_outage_holds_good_records_and_dead_letters_nothing(kafka, registry):
    cfg, topics, producer = _setup(kafka, registry)
    spec = make_group("during", 2, seed=71)
    with RunningStage(cfg) as stage:             # start() registers the output schemas
        stats, runtime = stage.runtime.stats, stage.runtime
        stage.wait(lambda: runtime.ready, 60, "ready")
        registry.stop()                            # before the stage has resolved any input schema
        _send(producer, spec)
        stage.wait(lambda: stats.gauges.get("schema_registry_unavailable") == 1.0, 30, "outage noticed")
        ok, why = runtime.readiness()
        assert not ok and "schema registry unavailable" in why
        time.sleep(4)                              # the records wait; the loop goes on polling
        assert time.monotonic() - stats.last_loop_at < 1.0
        assert stats.total("dead_letters") == 0 and stats.total("groups_published") == 0
        held = _committed(kafka, cfg)
        assert held[topics.receipts] <= 0 and held[topics.staged_calls] <= 0   # nothing committed
        registry.start()
        stage.wait(lambda: stats.total("groups_published") >= 1, 60, "publication after the outage")
        stage.wait(lambda: runtime.ready, 30, "ready again")
        assert stats.gauges["schema_registry_unavailable"] == 0.0
        # records put back while the registry was down are counted once, when consumed
        assert stats.count("records_consumed", topic=topics.receipts) == len(spec.receipts)
        assert stats.count("records_consumed", topic=topics.staged_calls) == len(spec.staged)
    (summary,) = [SUMMARY.decode(m.value()[5:]) for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    assert summary["group_id"] == "during"
    assert summary["outcome"] == "complete" and summary["valid_rows"] == 2
    assert read_all(kafka.bootstrap, topics.dead_letter, timeout=5) == []


def test_a_schema_id_the_registry_does_not_know_is_dead_lettered(kafka, registry):
    cfg, topics, producer = _setup(kafka, registry)
    good = make_group("good", 2, seed=72)
    feed = Feeder(kafka.bootstrap, topics)
    bogus = b"\x00" + (987654).to_bytes(4, "big") + b"\x02\x04"
    feed.raw(topics.receipts, b"good", bogus)
    feed.flush()
    _send(producer, good)
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "publication")
        stage.wait(lambda: stage.runtime.stats.total("dead_letters") >= 1, 30, "dead letter")
    (letter,) = read_all(kafka.bootstrap, topics.dead_letter)
    headers = dict(letter.headers())
    assert letter.value() == bogus
    assert headers["error-class"] == b"undecodable"
    assert b"schema id 987654" in headers["error"]


def test_sigterm_stops_the_stage_during_a_registry_outage(kafka, registry, tmp_path):
    cfg, topics, producer = _setup(kafka, registry)
    proc = StageProcess(cfg, tmp_path, "registry-down")
    try:
        proc.wait_for(lambda: "partition 0 ready" in proc.log(), 90, "partition assigned")
        registry.stop()
        _send(producer, make_group("waiting", 2, seed=73))
        proc.wait_for(lambda: "schema registry unavailable" in proc.log(), 60, "outage noticed")
        started = time.monotonic()
        proc.signal(signal.SIGTERM)
        assert proc.wait_exit(30) == 0
        assert time.monotonic() - started < 20
    finally:
        proc.close()
    assert read_all(kafka.bootstrap, topics.dead_letter, timeout=5) == []
