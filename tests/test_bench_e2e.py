"""bench e2e's inputs by reference (claim-check order, every record within the default cap) and
the figure of issue 26's first target: what the stage's consumer fetches in deferred mode."""

import json
import subprocess
import sys
import uuid

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.bench import e2e
from stage.runtime.kafka.topics import create_topics
from stage.wire import DEFAULT_MAX_RECORD_BYTES, AvroCodec


def test_fetched_bytes_sums_the_partitions_rxbytes_per_topic_without_librdkafkas_own():
    stats = {"topics": {"a": {"partitions": {"0": {"rxbytes": 10}, "1": {"rxbytes": 5},
                                             "-1": {"rxbytes": 99}}},
                        "b": {"partitions": {"0": {}}}}}
    assert e2e.fetched_bytes(json.dumps(stats)) == {"a": 15, "b": 0}
    assert e2e.fetched_bytes("{}") == {}


def test_the_anchor_is_no_routes_for_deferred_and_inline_for_direct_by_reference():
    assert e2e.anchor_kind("deferred", "by-reference", True) == "no-routes"
    assert e2e.anchor_kind("deferred", "inline", True) == "no-routes"
    assert e2e.anchor_kind("direct", "by-reference", True) == "inline"
    assert e2e.anchor_kind("direct", "inline", True) is None
    assert e2e.anchor_kind("off", "by-reference", True) is None
    assert e2e.anchor_kind("deferred", "by-reference", False) is None


def test_latency_is_judged_with_chunks_ahead_only_where_the_stage_does_not_read_them():
    assert e2e.chunks_ahead_feed("deferred", "by-reference", True)
    assert e2e.chunks_ahead_feed("off", "by-reference", True)
    assert not e2e.chunks_ahead_feed("direct", "by-reference", True)    # the stage reads the chunks
    assert not e2e.chunks_ahead_feed("deferred", "inline", True)
    assert not e2e.chunks_ahead_feed("deferred", "by-reference", False)


def _read_all(bootstrap: str, topic: str, partitions: int) -> list:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    out = []
    try:
        for p in range(partitions):
            _low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), 10)
            if not high:
                continue
            consumer.assign([TopicPartition(topic, p, 0)])
            got = []
            while len(got) < high:
                got += [m for m in consumer.consume(100, 1.0) if not m.error()]
            out += got
    finally:
        consumer.close()
    return out


def test_inputs_by_reference_put_chunks_first_and_the_deferred_stage_fetches_no_route_bytes(kafka):
    topics = e2e._topics(f"t{uuid.uuid4().hex[:6]}")
    cfg = e2e._config(kafka.bootstrap, topics, "deferred", DEFAULT_MAX_RECORD_BYTES)
    create_topics(AdminClient({"bootstrap.servers": kafka.bootstrap}), cfg, partitions=2, replication=1,
                  min_insync_replicas=1, max_message_bytes=DEFAULT_MAX_RECORD_BYTES + (1 << 20))
    _wl, inputs, _tokens = e2e.profile_inputs("toy", 3, None)
    inputs = e2e.by_reference(inputs)
    staged_with_routes = sum(isinstance(v, dict) for _g, records in inputs for _r, v in records)
    assert staged_with_routes > 0
    writer = e2e.Writer(kafka.bootstrap, topics, DEFAULT_MAX_RECORD_BYTES)
    e2e._fill(writer, inputs)

    chunks = {(m.partition(), m.offset()): m for m in _read_all(kafka.bootstrap, topics.staged_routes, 2)}
    staged = _read_all(kafka.bootstrap, topics.staged_calls, 2)
    chunk_codec, staged_codec = AvroCodec("RouteChunk"), AvroCodec("StagedCall")
    by_reference = 0
    for m in staged:
        assert len(m.value()) <= DEFAULT_MAX_RECORD_BYTES
        call = staged_codec.decode(m.value())
        assert call["routed_experts"] is None       # no route payload inside a staged call
        ref = call["routes_ref"]
        if ref is None:
            continue
        by_reference += 1
        assert ref["topic"] == topics.staged_routes and ref["partition"] == m.partition()
        for index, c in enumerate(ref["chunks"]):
            record = chunks[(ref["partition"], c["offset"])]     # the real offset of the chunk
            chunk = chunk_codec.decode(record.value())
            assert (chunk["staging_key"], chunk["index"], chunk["sha256"]) == \
                (call["staging_key"], index, c["sha256"])
            # claim-check: produced only after the chunk was acknowledged
            assert record.timestamp()[1] <= m.timestamp()[1]
    assert by_reference == staged_with_routes
    assert writer.nbytes[topics.staged_routes] == sum(len(m.value()) for m in chunks.values())

    seconds, fetched = e2e.run_stage(cfg, 3)
    assert seconds > 0
    read = writer.nbytes[topics.receipts] + writer.nbytes[topics.staged_calls]
    assert fetched.get(topics.staged_routes, 0) == 0
    assert fetched[topics.staged_calls] + fetched[topics.receipts] >= read
    assert sum(fetched.values()) < writer.written_bytes


def test_bench_e2e_toy_by_reference_reports_the_targets(kafka):
    proc = subprocess.run([sys.executable, "-m", "stage", "bench", "e2e", "--json", "--profile", "toy",
                           "--groups", "2", "--routes", "deferred", "--latency-seconds", "1",
                           "--repeats", "1", "--bootstrap-servers", kafka.bootstrap], capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout)
    assert proc.returncode == (0 if report["meets_targets"] else 1), proc.stderr[-2000:]
    assert report["route_staging"] == "by-reference" and report["record_cap"] == DEFAULT_MAX_RECORD_BYTES
    routes_topic = next(t for t in report["written"]["bytes"] if t.endswith("staged-routes"))
    assert report["written"]["bytes"][routes_topic] > 0
    assert report["stage"]["fetched_bytes"].get(routes_topic, 0) == 0
    share = report["targets"]["consumed_share"]
    assert share["value"] == report["stage"]["fetched_total_bytes"] / report["written"]["total_bytes"]
    assert 0 < share["value"] < 1 and share["target"] == 0.05
    assert report["anchor"]["kind"] == "no-routes" and "no_routes_ratio" in report["targets"]
    # the anchor is the same groups without routes (same tokens), one anchor/stage/stage/anchor block
    assert report["anchor"]["canonical_tokens"] == report["workload"]["canonical_tokens"]
    assert [name for name, _ in report["run_order"]] == ["anchor", "stage", "stage", "anchor"]
    # latency judged on a second feed whose route chunks were on the broker before it
    ahead = report["latency_chunks_ahead"]
    assert ahead["groups"] == report["latency"]["groups"] > 0
    assert report["targets"]["latency_p99_ms"]["value"] == ahead["p99_ms"]


def test_chunks_written_ahead_leaves_staged_calls_naming_chunks_already_on_the_broker(kafka):
    topics = e2e._topics(uuid.uuid4().hex[:6])
    cfg = e2e._config(kafka.bootstrap, topics, "deferred")
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    create_topics(admin, cfg, partitions=2, replication=1, min_insync_replicas=1,   # as bench e2e does
                  max_message_bytes=cfg.max_record_bytes + (1 << 20))
    _wl, inputs, _tokens = e2e.profile_inputs("toy", 2, None)
    source = list(inputs)
    converted = e2e.by_reference(source)
    assert source == []     # emptied as converted: a latency phase's groups are not held twice
    ahead = e2e.chunks_written_ahead(kafka.bootstrap, cfg, converted, admin, 2)
    assert len(ahead) == len(inputs) == 2
    codec = AvroCodec("StagedCall")
    chunks = {(m.partition(), m.offset()) for m in _read_all(kafka.bootstrap, topics.staged_routes, 2)}
    assert [g for g, _ in ahead] == [g for g, _ in inputs]
    for (group_id, records), (_g, original) in zip(ahead, inputs):
        roles = [role for role, _ in records]
        # the same records, every value encoded, staged calls first and receipts last (as sent last)
        assert sorted(roles) == sorted(role for role, _ in original)
        assert roles == sorted(roles, key=lambda role: role == "receipts")
        staged = [codec.decode(v) for role, v in records if role == "staged_calls"]
        refs = [c["routes_ref"] for c in staged if c["routes_ref"] is not None]
        assert refs and all(c["routed_experts"] is None for c in staged)
        # every chunk a staged call names is on the route topic already, in the call's partition
        assert all((r["partition"], c["offset"]) in chunks for r in refs for c in r["chunks"])
        assert len({r["partition"] for r in refs}) == 1
