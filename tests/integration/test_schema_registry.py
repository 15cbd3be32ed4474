"""Schema Registry framing with a registry that goes down and comes back: good records wait
(nothing dead-lettered, nothing committed past them), the loop keeps polling, readiness and a
metric say why, SIGTERM works. On the real registry (Apicurio, its storage in an H2 file so
that the restarted registry knows every id it gave out, as a production registry's storage
must), except a registry that answers 503, which only the stand-in (tests/support/registry.py)
can be made to do. A schema id the registry does not know: tests/integration/test_apicurio.py."""

import io
import json
import signal
import time

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from fastavro import parse_schema, schemaless_writer

from stage.client import StagingProducer
from stage.wire import AvroCodec, schema_json, value_subject
from tests.faults.procs import StageProcess
from tests.integration.harness import (
    RunningStage, make_group, read_all, send_group, setup_topics, stage_config, unique_topics,
)
from tests.support.apicurio import ApicurioRegistry, require_apicurio
from tests.support.registry import FakeRegistry
from tests.support.report import STARTED

SUMMARY = AvroCodec("GroupSummary")


@pytest.fixture(scope="module")
def apicurio_persistent(tmp_path_factory):
    """Apicurio without auth whose storage survives its restarts (an H2 database file)."""
    require_apicurio()
    registry = ApicurioRegistry(tmp_path_factory.mktemp("apicurio-persistent"), persistent=True)
    STARTED["apicurio_persistent"] = registry
    registry.start()
    yield registry
    registry.stop()


@pytest.fixture
def registry(apicurio_persistent):
    """The persistent registry, up at the start of each test and again after it."""
    if apicurio_persistent.proc.poll() is not None:
        apicurio_persistent.start()
    yield apicurio_persistent
    if apicurio_persistent.proc.poll() is not None:
        apicurio_persistent.start()


@pytest.fixture
def stand_in():
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


def _committed(kafka, cfg) -> dict:
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    request = ConsumerGroupTopicPartitions(cfg.group_id, [TopicPartition(cfg.topics.receipts, 0),
                                                          TopicPartition(cfg.topics.staged_calls, 0)])
    result = admin.list_consumer_group_offsets([request])[cfg.group_id].result()
    return {tp.topic: tp.offset for tp in result.topic_partitions}


def _evolved_receipts(registry, topics) -> tuple[int, dict]:
    """A second ReceiptEvent version under the receipts subject (one more field, with a default:
    BACKWARD accepts it), registered now; its id and parsed schema."""
    evolved = json.loads(schema_json("ReceiptEvent"))
    evolved["fields"].append({"name": "note", "type": ["null", "string"], "default": None})
    client = SchemaRegistryClient({"url": registry.url})
    schema_id = client.register_schema(value_subject(topics.receipts), Schema(json.dumps(evolved), "AVRO"))
    return schema_id, parse_schema(evolved)


def _send_evolved(producer, spec, schema_id: int, writer) -> None:
    for value in spec.staged:
        producer.send_staged(spec.group_id, value)
    for value in spec.receipts:
        body = io.BytesIO()
        schemaless_writer(body, writer, {**value, "note": "written by a newer producer"})
        producer.produce(producer.topics.receipts, spec.group_id,
                         b"\x00" + schema_id.to_bytes(4, "big") + body.getvalue())
    producer.flush()


def _summaries(kafka, topics) -> dict:
    return {s["group_id"]: s for s in (SUMMARY.decode(m.value()[5:])
                                       for m in read_all(kafka.bootstrap, topics.finalized_groups))}


def test_a_registry_restart_holds_good_records_and_dead_letters_nothing(kafka, registry):
    cfg, topics, producer = _setup(kafka, registry)
    newer_id, newer = _evolved_receipts(registry, topics)
    before, known, held = (make_group(name, 2, seed=seed) for name, seed in
                           (("before", 70), ("known", 71), ("held", 72)))
    with RunningStage(cfg) as stage:             # start() registers the output schemas
        stats, runtime = stage.runtime.stats, stage.runtime
        stage.wait(lambda: runtime.ready, 60, "ready")
        send_group(producer, before)
        stage.wait(lambda: stats.total("groups_published") >= 1, 60, "the first group")
        registry.kill()                            # a crash: connections refused
        send_group(producer, known)                     # schema ids the stage resolved already
        stage.wait(lambda: stats.total("groups_published") >= 2, 60, "a group of known ids")
        _send_evolved(producer, held, newer_id, newer)   # an id the stage has not resolved yet
        stage.wait(lambda: stats.gauges.get("schema_registry_unavailable") == 1.0, 30, "outage noticed")
        ok, why = runtime.readiness()
        assert not ok and "schema registry unavailable" in why
        time.sleep(4)                              # the records wait; the loop goes on polling
        assert time.monotonic() - stats.last_loop_at < 1.0
        assert stats.total("dead_letters") == 0 and stats.total("groups_published") == 2
        committed = _committed(kafka, cfg)         # nothing committed past the held group
        assert committed[topics.receipts] <= 4 and committed[topics.staged_calls] <= 12
        registry.start()                           # same ports, same storage: the ids are valid
        stage.wait(lambda: stats.total("groups_published") >= 3, 60, "publication after the restart")
        stage.wait(lambda: runtime.ready, 30, "ready again")
        assert stats.gauges["schema_registry_unavailable"] == 0.0
        # records put back while the registry was down are counted once, when consumed
        assert stats.count("records_consumed", topic=topics.receipts) == 6
        assert stats.count("records_consumed", topic=topics.staged_calls) == 18
    summaries = _summaries(kafka, topics)
    assert sorted(summaries) == ["before", "held", "known"]
    assert all(s["outcome"] == "complete" and s["valid_rows"] == 2 for s in summaries.values())
    assert read_all(kafka.bootstrap, topics.dead_letter, timeout=5) == []
    assert registry.starts == 2   # the same registry process was restarted, not replaced


def test_a_registry_answering_503_holds_good_records(kafka, stand_in):
    """A registry that is up but failing (its storage down): only the stand-in can be made to."""
    cfg, topics, producer = _setup(kafka, stand_in)
    spec = make_group("during", 2, seed=73)
    with RunningStage(cfg) as stage:
        stats, runtime = stage.runtime.stats, stage.runtime
        stage.wait(lambda: runtime.ready, 60, "ready")
        stand_in.status = 503
        send_group(producer, spec)
        stage.wait(lambda: stats.gauges.get("schema_registry_unavailable") == 1.0, 30, "outage noticed")
        ok, why = runtime.readiness()
        assert not ok and "503" in why
        time.sleep(2)
        assert stats.total("dead_letters") == 0 and stats.total("groups_published") == 0
        held = _committed(kafka, cfg)
        assert held[topics.receipts] <= 0 and held[topics.staged_calls] <= 0
        stand_in.status = None
        stage.wait(lambda: stats.total("groups_published") >= 1, 60, "publication after the outage")
    assert _summaries(kafka, topics)["during"]["valid_rows"] == 2
    assert read_all(kafka.bootstrap, topics.dead_letter, timeout=5) == []


def test_sigterm_stops_the_stage_during_a_registry_outage(kafka, registry, tmp_path):
    cfg, topics, producer = _setup(kafka, registry)
    proc = StageProcess(cfg, tmp_path, "registry-down")
    try:
        proc.wait_for(lambda: "partition 0 ready" in proc.log(), 90, "partition assigned")
        registry.kill()
        send_group(producer, make_group("waiting", 2, seed=74))
        proc.wait_for(lambda: "schema registry unavailable" in proc.log(), 60, "outage noticed")
        started = time.monotonic()
        proc.signal(signal.SIGTERM)
        assert proc.wait_exit(30) == 0
        assert time.monotonic() - started < 20
    finally:
        proc.close()
    assert read_all(kafka.bootstrap, topics.dead_letter, timeout=5) == []
