"""The stage with Schema Registry framing on a real registry (Apicurio Registry's Confluent-compatible
API, basic auth required): inputs from the SDK, outputs read by a plain confluent-kafka consumer
with confluent-kafka's own AvroDeserializer (a reader that is not the project's), the subjects and
the compatibility rule docs/schemas.md states, and a schema change the registry refuses (exit 9)."""

import json
import logging
import uuid

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from fastavro import parse_schema
from fastavro.schema import to_parsing_canonical_form

from stage.client import CanonicalReader, StagingProducer
from stage.finalize import ReassemblyConfig
from stage.runtime.exits import EXIT_SCHEMA_REGISTRY
from stage.wire import AvroCodec, schema_json, value_subject
from tests.faults.procs import StageProcess
from tests.integration.harness import (
    Feeder, RunningStage, expected_rows, make_group, read_all, send_group, setup_topics, stage_config,
    unique_topics,
)

FINALIZE = ReassemblyConfig(router_replay=True, defer_routes=False)


def _canonical(text: str) -> str:
    return to_parsing_canonical_form(parse_schema(json.loads(text), named_schemas={}))


def _client(apicurio) -> SchemaRegistryClient:
    """confluent-kafka's client built here, not through the project's helper."""
    return SchemaRegistryClient({"url": apicurio.url, "basic.auth.user.info": apicurio.user_info})


def _config(kafka, apicurio, topics, **overrides):
    return stage_config(kafka.bootstrap, topics, framing="confluent", schema_registry_url=apicurio.url,
                        schema_registry={"basic_auth_user_info": apicurio.user_info}, **overrides)


def _producer(kafka, apicurio, topics) -> StagingProducer:
    return StagingProducer(kafka.bootstrap, topics=topics, framing="confluent",
                           schema_registry_url=apicurio.url,
                           schema_registry_config={"basic.auth.user.info": apicurio.user_info})


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def published(kafka, apicurio):
    """One stage run over SDK-produced groups; what it published and logged (at DEBUG)."""
    topics = unique_topics()
    cfg = _config(kafka, apicurio, topics, finalize=FINALIZE)
    setup_topics(cfg, partitions=2)
    groups = [make_group(f"sr-{i}", 3, seed=80 + i) for i in range(3)]
    producer = _producer(kafka, apicurio, topics)
    for spec in groups:
        send_group(producer, spec)
    captured, root = _Captured(), logging.getLogger()
    level = root.level
    root.addHandler(captured)
    root.setLevel(logging.DEBUG)
    try:
        with RunningStage(cfg) as stage:
            stage.wait(lambda: stage.runtime.stats.total("groups_published") >= len(groups), 90,
                       "every group published")
            assert stage.runtime.stats.total("dead_letters") == 0
    finally:
        root.removeHandler(captured)
        root.setLevel(level)
    return cfg, topics, groups, producer, captured.lines


def _deserialized(kafka, apicurio, topic: str) -> list[tuple[int, dict]]:
    """(schema id in the header, value) of every record of ``topic``, read by confluent-kafka's
    AvroDeserializer with the writer schema it fetched from the registry by id."""
    deserializer = AvroDeserializer(_client(apicurio))
    out = []
    for message in read_all(kafka.bootstrap, topic):
        value = deserializer(message.value(), SerializationContext(topic, MessageField.VALUE))
        out.append((int.from_bytes(message.value()[1:5], "big"), value))
    return out


def test_outputs_read_by_confluents_deserializer_equal_the_library(kafka, apicurio, published):
    cfg, topics, groups, _, _ = published
    client = _client(apicurio)
    rows = _deserialized(kafka, apicurio, topics.canonical_rows)
    summaries = _deserialized(kafka, apicurio, topics.finalized_groups)
    for topic, records in ((topics.canonical_rows, rows), (topics.finalized_groups, summaries)):
        latest = client.get_latest_version(value_subject(topic)).schema_id
        assert {schema_id for schema_id, _ in records} == {latest}   # the subject's registered id
    assert sorted(s["group_id"] for _, s in summaries) == sorted(g.group_id for g in groups)
    assert all(s["outcome"] == "complete" and s["valid_rows"] == 3 for _, s in summaries)
    for spec in groups:
        got = sorted((r for _, r in rows if r["group_id"] == spec.group_id), key=lambda r: r["row_index"])
        assert got == expected_rows(spec, FINALIZE)
        assert all(r["routed_experts"] is not None for r in got)   # packed tensors came through


def test_the_inputs_carry_the_ids_the_sdk_registered(kafka, apicurio, published):
    _, topics, groups, producer, _ = published
    client = _client(apicurio)
    for topic, name in ((topics.staged_calls, "StagedCall"), (topics.receipts, "ReceiptEvent"),
                        (topics.staged_routes, "RouteChunk")):
        ids = {int.from_bytes(m.value()[1:5], "big") for m in read_all(kafka.bootstrap, topic)}
        assert ids == {producer.codecs[name].schema_id}
        # Apicurio stores Avro's own rendering (nested namespaces dropped, keys reordered): the
        # same schema by its parsing canonical form, which is what the stage's reader compares
        registered = client.get_schema(producer.codecs[name].schema_id)
        assert _canonical(registered.schema_str) == _canonical(schema_json(name))


def test_subjects_follow_the_topic_name_strategy_with_backward_compatibility(kafka, apicurio, published):
    _, topics, _, _, _ = published
    client = _client(apicurio)
    expected = {value_subject(t) for t in (topics.receipts, topics.staged_calls, topics.staged_routes,
                                           topics.canonical_rows, topics.route_plans, topics.finalized_groups,
                                           topics.stage_ledger)}
    ours = {s for s in client.get_subjects() if s.startswith(topics.receipts.split(".")[0] + ".")}
    assert ours == expected                    # the dead-letter topic holds raw bytes: no subject
    for subject in expected:
        assert client.get_compatibility(subject) == "BACKWARD"
    # what BACKWARD lets a new version of GroupSummary do (docs/schemas.md, Subjects and compatibility)
    subject = value_subject(topics.finalized_groups)
    base = json.loads(schema_json("GroupSummary"))

    def variant(change) -> Schema:
        schema = json.loads(json.dumps(base))
        change(schema["fields"])
        return Schema(json.dumps(schema), "AVRO")

    def symbols(change):
        def edit(fields):
            outcome = next(x for x in fields if x["name"] == "outcome")["type"]
            outcome["symbols"] = change(outcome["symbols"])
        return edit

    assert client.test_compatibility(subject, variant(
        lambda f: f.append({"name": "note", "type": ["null", "string"], "default": None})))
    assert not client.test_compatibility(subject, variant(
        lambda f: f.append({"name": "note", "type": "string"})))              # no default
    assert not client.test_compatibility(subject, variant(lambda f: next(
        x for x in f if x["name"] == "valid_rows").update(type="string")))   # a type changed in place
    assert not client.test_compatibility(subject, variant(symbols(lambda s: s[:-1])))   # a symbol removed
    # BACKWARD only checks that the new version reads the old records: it accepts two changes
    # the evolution rule forbids because readers still on the old version would fail on them
    assert client.test_compatibility(subject, variant(lambda f: f.remove(
        next(x for x in f if x["name"] == "finalized_at_ms"))))              # a field without default removed
    assert client.test_compatibility(subject, variant(symbols(lambda s: [*s, "vanished"])))   # a symbol added


def test_the_project_reader_and_the_operator_commands_read_through_the_authenticated_registry(
        kafka, apicurio, published, tmp_path):
    cfg, topics, groups, _, _ = published
    reader = CanonicalReader(kafka.bootstrap, topics=topics, framing="confluent",
                             schema_registry_url=apicurio.url,
                             schema_registry_config={"basic.auth.user.info": apicurio.user_info})
    try:
        got = {}
        for _ in range(200):
            for group in reader.poll(timeout=0.2):
                got[group.group_id] = group
            if len(got) == len(groups):
                break
    finally:
        reader.close()
    assert sorted(got) == sorted(g.group_id for g in groups)
    from stage.debug.inspect_group import GroupInspector
    from stage.debug.kafka import PartitionReader, Progress
    from stage.runtime.kafka.registry import build_codecs
    part = PartitionReader(cfg, "inspect", Progress(False))
    try:
        report = GroupInspector(cfg, part, build_codecs(cfg)).report(groups[0].group_id)
    finally:
        part.close()
    assert [s["group_id"] for s in report["summaries"]] == [groups[0].group_id]


def test_no_log_line_of_the_run_shows_the_password(published, apicurio):
    lines = published[4]
    password = apicurio.user_info.split(":", 1)[1]
    assert any("stage started" in line for line in lines)      # the capture saw the run
    assert not [line for line in lines if password in line]


def test_a_schema_id_the_registry_does_not_know_is_dead_lettered(kafka, apicurio):
    topics = unique_topics()
    cfg = _config(kafka, apicurio, topics, group_timeout_ms=600_000)
    setup_topics(cfg, partitions=1)
    feed = Feeder(kafka.bootstrap, topics)
    bogus = b"\x00" + (987_654_321).to_bytes(4, "big") + b"\x02\x04"
    feed.raw(topics.receipts, b"good", bogus)
    feed.flush()
    send_group(_producer(kafka, apicurio, topics), make_group("good", 2, seed=72))
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "publication")
        stage.wait(lambda: stage.runtime.stats.total("dead_letters") >= 1, 30, "dead letter")
    (letter,) = read_all(kafka.bootstrap, topics.dead_letter)
    headers = dict(letter.headers())
    assert letter.value() == bogus
    assert headers["error-class"] == b"undecodable"
    assert b"schema id 987654321" in headers["error"]


def test_an_output_schema_the_registry_refuses_stops_the_start_with_exit_9(kafka, apicurio, tmp_path):
    topics = unique_topics()
    cfg = _config(kafka, apicurio, topics).replace(schema_registry={})   # the secret goes by env
    setup_topics(cfg, partitions=1)
    subject = value_subject(topics.canonical_rows)
    # an earlier CanonicalRow under the subject: ours adds fields without defaults, which a
    # BACKWARD rule refuses (a reader of the new version could not read the old records)
    earlier = {"type": "record", "name": "CanonicalRow", "namespace": "rollout_reassembler.v1",
               "fields": [{"name": "group_id", "type": "string"}]}
    _client(apicurio).register_schema(subject, Schema(json.dumps(earlier), "AVRO"))
    env = {"ROLLOUT_REASSEMBLER_SCHEMA_REGISTRY__BASIC_AUTH_USER_INFO": apicurio.user_info}
    proc = StageProcess(cfg, tmp_path, "incompatible", extra_env=env)
    try:
        assert proc.wait_exit(120) == EXIT_SCHEMA_REGISTRY, proc.tail()
    finally:
        proc.close()
    log = proc.log()
    assert f"cannot register the CanonicalRow schema under subject {subject}" in log
    assert "incompatible with the versions already registered under this subject" in log
    assert "409" in log
    assert apicurio.user_info.split(":", 1)[1] not in log
    assert read_all(kafka.bootstrap, topics.canonical_rows, timeout=5) == []


def test_without_the_credentials_the_stage_refuses_to_start_at_once(kafka, apicurio):
    from stage.runtime.exits import StageExit
    from stage.runtime.loop import StageRuntime
    topics = unique_topics()
    setup_topics(_config(kafka, apicurio, topics), partitions=1)
    for settings in ({}, {"basic_auth_user_info": "stage:wrong-password"}):
        cfg = _config(kafka, apicurio, topics).replace(schema_registry=settings)
        runtime = StageRuntime(cfg)
        with pytest.raises(StageExit) as info:
            runtime.start()
        runtime.stop()
        assert info.value.code == EXIT_SCHEMA_REGISTRY
        assert "401" in str(info.value) and "check schema_registry.basic_auth_user_info" in str(info.value)


def test_a_reader_the_registry_refuses_waits_instead_of_dead_lettering(apicurio):
    """401 on a lookup says nothing about the record: the loop holds it (retriable)."""
    from stage.runtime.kafka.registry import registry_client
    from stage.wire import RegistryError
    client = _client(apicurio)
    schema_id = client.register_schema(f"probe-{uuid.uuid4().hex[:6]}-value",
                                       Schema(schema_json("LedgerEntry"), "AVRO"))
    cfg = stage_config("127.0.0.1:1", unique_topics(), framing="confluent",
                       schema_registry_url=apicurio.url)
    codec = AvroCodec("LedgerEntry", framing="confluent", registry=registry_client(cfg))
    with pytest.raises(RegistryError) as info:
        codec.prefetch(schema_id)
    assert info.value.retriable and info.value.status == 401
    authed = AvroCodec("LedgerEntry", framing="confluent", registry=registry_client(
        cfg.replace(schema_registry={"basic_auth_user_info": apicurio.user_info})))
    authed.prefetch(schema_id)   # resolves: the id was fine all along
    assert schema_id in authed._writers
