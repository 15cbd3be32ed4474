"""Routes by reference from the producer SDK, on a real broker: every chunk is acknowledged
before the StagedCall that names it (delivery order, record timestamps), the reference finds and
checks the chunks where they landed, the bytes join back to the routes and the Gym extras digest
over them is the one the receipt carries; a chunk the broker refuses leaves no StagedCall and
flush names it; routes_by_reference=False writes the old inline record."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from stage.client import DeliveryError, RolloutStager, StagingProducer
from stage.contract import compute_extras_digest, encode_routed_experts
from stage.staging.route_refs import RouteReference, check_chunk, join_chunks
from stage.wire import AvroCodec
from tests.integration.harness import read_all, setup_topics, stage_config, unique_topics

STAGED, CHUNKS = AvroCodec("StagedCall"), AvroCodec("RouteChunk")
L, K = 48, 8
CHUNK_BYTES = 40_000           # a 300-token int8 call (115,200 route bytes) is 3 chunks


def stage_rollout(producer, group_id: str, rng, *, turns: int = 2, tokens: int = 300):
    """One rollout of ``turns`` calls with int8 48x8 routes; returns (manifest rows, routes by key)."""
    stager = RolloutStager(producer, group_id, f"{group_id}-r0")
    rows, routes, parent = [], {}, None
    for t in range(turns):
        prompt = tokens - 20
        kwargs = dict(prompt_delta=rng.integers(0, 50_000, prompt), generated=rng.integers(0, 50_000, 20),
                      generated_logprobs=-rng.random(20), weight_version=3, route_dtype="int8",
                      routed_experts=rng.integers(-1, 128, (tokens, L, K)))
        if parent is not None:
            kwargs["routed_experts_boundary"] = rng.integers(0, 128, (1, L, K))
        row = stager.stage(f"c{t}", parent_call_id=parent, **kwargs)
        rows.append(row)
        routes[row.staging_key] = (kwargs["routed_experts"], kwargs.get("routed_experts_boundary"))
        parent = f"c{t}"
    return rows, routes


def test_chunks_are_acknowledged_before_their_call_and_join_back_to_the_routes(kafka):
    topics = unique_topics()
    setup_topics(stage_config(kafka.bootstrap, topics), partitions=2)
    deliveries = []
    producer = StagingProducer(kafka.bootstrap, topics=topics, route_chunk_bytes=CHUNK_BYTES,
                               on_delivery=deliveries.append)
    rows, routes = {}, {}
    # one producer shared by worker threads, as an inference fleet does (callbacks on any thread)
    with ThreadPoolExecutor(3) as workers:
        staged = list(workers.map(lambda args: stage_rollout(producer, args[0], np.random.default_rng(args[1])),
                                  [("rc-a", 7), ("rc-b", 8), ("rc-c", 9)]))
    for got_rows, got_routes in staged:
        rows.update({r.staging_key: r for r in got_rows})
        routes.update(got_routes)
    producer.flush(60)
    assert producer.deferred == 0 and not producer.failures

    calls = read_all(kafka.bootstrap, topics.staged_calls, expect=len(rows))
    chunk_messages = read_all(kafka.bootstrap, topics.staged_routes, expect=3 * len(rows))
    assert len(calls) == len(rows) and len(chunk_messages) == 3 * len(rows)
    by_coordinates = {(m.partition(), m.offset()): m for m in chunk_messages}
    assert len({m.partition() for m in calls}) > 1          # the groups span both partitions
    acked = {(d.topic, d.partition, d.offset): i for i, d in enumerate(deliveries)}
    for message in calls:
        call = STAGED.decode(message.value())
        key = call["staging_key"]
        assert call["routed_experts"] is None and message.key() == call["group_id"].encode()
        ref = RouteReference.from_value(call["routes_ref"], max_chunk_bytes=CHUNK_BYTES,
                                        delta_len=call["delta_len"])   # what the readers check first
        assert (ref.topic, ref.partition, ref.dtype, ref.shape) == \
            (topics.staged_routes, message.partition(), "int8", (300, L, K))
        assert [c.length for c in ref.chunks] == [40_000, 40_000, 35_200]
        datas = []
        for index, chunk_ref in enumerate(ref.chunks):
            chunk_message = by_coordinates[(ref.partition, chunk_ref.offset)]
            chunk = CHUNKS.decode(chunk_message.value())
            datas.append(check_chunk(ref, index, chunk, group_id=call["group_id"], staging_key=key))
            assert chunk_message.key() == message.key()
            # claim-check order: the chunk was acknowledged, and written, before its call
            assert acked[(topics.staged_routes, ref.partition, chunk_ref.offset)] < \
                acked[(topics.staged_calls, message.partition(), message.offset())]
            assert chunk_message.timestamp()[1] <= message.timestamp()[1]
        joined = np.frombuffer(bytes(join_chunks(ref, datas)), np.int8).reshape(ref.shape)
        full, boundary = routes[key]
        assert np.array_equal(joined, full)
        # the extras digest over the joined routes is the one the receipt names (unchanged vs inline)
        extras = json.loads(call["extras_metadata_json"])
        extras["routed_experts"] = encode_routed_experts(joined, "int8")
        if boundary is not None:
            got = call["routed_experts_boundary"]
            assert got["shape"] == [1, L, K] and got["data"] == boundary.astype(np.int8).tobytes()
            extras["routed_experts_boundary"] = encode_routed_experts(boundary, "int8")
        assert compute_extras_digest(extras) == call["extras_digest"] == rows[key].extras_digest


def wait_until_refused(bootstrap: str, topic: str, timeout: float = 30.0) -> None:
    """Wait until the broker enforces the altered max.message.bytes on both partitions: the
    alteration is acknowledged once the controller has it, and the partition's log takes the new
    config a little later (a record produced in between was accepted: CI saw the test's chunk land)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    deadline = time.monotonic() + timeout
    for partition in (0, 1):
        while True:
            outcome = []
            producer.produce(topic, b"x" * CHUNK_BYTES, partition=partition,
                             on_delivery=lambda error, _message: outcome.append(error))
            producer.flush(10)
            if outcome and outcome[0] is not None and outcome[0].code() == KafkaError.MSG_SIZE_TOO_LARGE:
                break
            assert time.monotonic() < deadline, f"{topic}[{partition}] still takes {CHUNK_BYTES} B records"
            time.sleep(0.2)


@pytest.mark.parametrize("how", ["record too large", "route topic missing"])
def test_a_chunk_the_broker_refuses_leaves_no_staged_call_and_flush_names_it(kafka, how):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    config = {}
    if how == "record too large":      # the route topic takes 30 kB records: a 40 kB chunk does not fit
        setup_topics(cfg, partitions=2)
        admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
        resource = ConfigResource(ConfigResource.Type.TOPIC, topics.staged_routes, incremental_configs=[
            ConfigEntry("max.message.bytes", "30000", incremental_operation=AlterConfigOpType.SET)])
        for future in admin.incremental_alter_configs([resource]).values():
            future.result(30)
        wait_until_refused(kafka.bootstrap, topics.staged_routes)
    else:                              # the brokers do not create topics on first use
        setup_topics(cfg, partitions=2)
        topics = topics.model_copy(update={"staged_routes": f"{topics.staged_routes}-absent"})
        config = {"message.timeout.ms": 5000}
    producer = StagingProducer(kafka.bootstrap, topics=topics, route_chunk_bytes=CHUNK_BYTES, config=config)
    stage_rollout(producer, "refused", np.random.default_rng(1), turns=1)
    with pytest.raises(DeliveryError) as raised:
        producer.flush(60)
    staged_failures = [f for f in raised.value.failures if f.topic == topics.staged_calls]
    assert len(staged_failures) == 1 and staged_failures[0].key == b"refused"
    assert staged_failures[0].error.startswith(
        f"StagedCall refused-r0/c0 not produced: route chunk(s) 0, 1, 2 of 3 to {topics.staged_routes} "
        "not delivered (")
    assert "StagedCall refused-r0/c0 not produced" in str(raised.value) and producer.deferred == 0
    assert read_all(kafka.bootstrap, topics.staged_calls, timeout=5) == []


def test_routes_by_reference_off_writes_the_inline_record(kafka):
    topics = unique_topics()
    setup_topics(stage_config(kafka.bootstrap, topics), partitions=2)
    producer = StagingProducer(kafka.bootstrap, topics=topics, routes_by_reference=False)
    rows, routes = stage_rollout(producer, "inline", np.random.default_rng(3))
    producer.flush(60)
    calls = [STAGED.decode(m.value()) for m in read_all(kafka.bootstrap, topics.staged_calls, expect=len(rows))]
    assert [c["staging_key"] for c in calls] == [r.staging_key for r in rows]
    for call in calls:
        assert call["routes_ref"] is None
        assert call["routed_experts"]["data"] == routes[call["staging_key"]][0].astype(np.int8).tobytes()
    assert read_all(kafka.bootstrap, topics.staged_routes, timeout=5) == []
