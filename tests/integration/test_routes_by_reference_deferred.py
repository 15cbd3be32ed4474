"""Routes staged by reference, deferred mode, on a real broker: the stage never reads the route
topic and publishes plans naming the chunks; the trainer's fetcher reads exactly those chunks,
verifies them and rebuilds the routes the inline path gives. Chunk loss, duplication,
reordering, corruption and expiry are each one row's failure with its reason."""

import json

import torch
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from stage.client import DeferredRouteFetcher
from stage.client.assembly import GroupAssembler
from stage.finalize import ReassemblyConfig
from stage.wire import AvroCodec, unpack_torch
from tests.integration.harness import (
    Feeder, RunningStage, expected_rows, make_group, read_all, setup_topics, stage_config, unique_topics,
)
from tests.routes.by_reference import ChunkWriter, by_reference, reference, route_chunks

L, K = 3, 2
CHUNK = 40            # bytes a chunk: a call's routes ([6 or 7, 3, 2] int8) are 1-2 chunks
CLIENT = {"fetch.wait.max.ms": 20}
ROWS, PLANS = AvroCodec("CanonicalRow"), AvroCodec("RoutePlan")
DEFERRED = ReassemblyConfig(router_replay=True, defer_routes=True, route_layers=L, route_topk=K)
DIRECT = ReassemblyConfig(router_replay=True, defer_routes=False, route_layers=L, route_topk=K)


def _run_stage(kafka, topics, specs, staged_values):
    """Feed the groups (their staged calls as given), run a deferred stage until each group is
    published; the route topic's partitions it was ever assigned and the topics its
    librdkafka statistics ever named."""
    cfg = stage_config(kafka.bootstrap, topics, finalize=DEFERRED, statistics_interval_ms=200)
    feeder = Feeder(kafka.bootstrap, topics)
    for spec in specs:
        feeder.staged(spec, staged_values[spec.group_id])
        feeder.receipts(spec)
    feeder.flush()
    assigned, stat_topics = set(), set()
    stage = RunningStage(cfg)
    sink = stage.runtime.stats.sink
    original = sink.librdkafka_stats

    def stats(text):
        stat_topics.update(json.loads(text).get("topics", {}))
        return original(text)

    sink.librdkafka_stats = stats
    assignment = stage.runtime.assignment
    assign = assignment.assign

    def assign_and_record(consumer, partitions):
        # Read in the stage's own thread, inside its rebalance callback: the consumer is the
        # stage's, and asking it from the test's thread (consumer.assignment()) once hung the
        # suite while the stage was busy with it.
        assign(consumer, partitions)
        assigned.update(tp.topic for tp in consumer.assignment())

    assignment.assign = assign_and_record
    with stage:
        def done():
            return stage.runtime.stats.total("groups_published") >= len(specs) and stat_topics
        stage.wait(done, 90, "all groups published")
    return assigned, stat_topics


def _groups(kafka, topics, n_groups):
    assembler = GroupAssembler(with_plans=True)
    groups = {}
    rows = read_all(kafka.bootstrap, topics.canonical_rows)
    plans = read_all(kafka.bootstrap, topics.route_plans)
    for msg in rows:
        assembler.add_row(ROWS.decode(msg.value()))
    for msg in plans:
        group = assembler.add_plan(PLANS.decode(msg.value()))
        if group is not None:
            groups[group.group_id] = group
    assert len(groups) == n_groups, (len(groups), assembler.counts)
    return groups


def _writer(kafka, topics):
    feeder = Feeder(kafka.bootstrap, topics)
    return ChunkWriter(feeder.producer, topics.staged_routes, AvroCodec("RouteChunk"))


def _unpack(packed):
    return unpack_torch(packed)


def test_deferred_stage_plans_chunks_it_never_reads_and_the_fetcher_rebuilds_the_routes(kafka):
    topics = unique_topics()
    setup_topics(stage_config(kafka.bootstrap, topics), partitions=2)
    specs = [make_group(f"byref{i}", 3, calls=3, seed=i, routes=(L, K)) for i in range(3)]
    writer = _writer(kafka, topics)
    staged = {spec.group_id: [writer.stage(v, CHUNK) for v in spec.staged] for spec in specs}
    chunk_count = sum(len(v["routes_ref"]["chunks"]) for vs in staged.values() for v in vs)
    assert chunk_count > sum(len(vs) for vs in staged.values())      # calls of several chunks
    assert all(v["routed_experts"] is None for vs in staged.values() for v in vs)
    assigned, stat_topics = _run_stage(kafka, topics, specs, staged)
    assert topics.staged_calls in assigned and topics.staged_routes not in assigned
    assert topics.staged_calls in stat_topics and topics.staged_routes not in stat_topics

    groups = _groups(kafka, topics, len(specs))
    with DeferredRouteFetcher(kafka.bootstrap, dims=(L, K), config=CLIENT, timeout=5.0) as fetcher:
        for spec in specs:
            group = groups[spec.group_id]
            assert all(row.valid for row in group.rows)
            spans = [s for plan in group.plans for s in plan["spans"] if s["staged_route_len"] > 0]
            assert spans and all(s["fragment"] is None and s["chunks"] is not None for s in spans)
            routes = fetcher.attach(group)
            for got, want in zip(routes, expected_rows(spec, DIRECT)):
                assert torch.equal(got, _unpack(want["routed_experts"]))
        assert fetcher.failures == {}
        assert fetcher.fetched == 0 and fetcher.chunks_fetched == chunk_count   # chunks only, once each
        again = fetcher.attach(groups[specs[0].group_id])     # from the cache: nothing read
        assert fetcher.chunks_fetched == chunk_count and fetcher.failures == {}
        assert all(torch.equal(a, _unpack(w["routed_experts"]))
                   for a, w in zip(again, expected_rows(specs[0], DIRECT)))


def _flip(chunk):
    data = bytearray(chunk["data"])
    data[len(data) // 2] ^= 0x01
    return {**chunk, "data": bytes(data)}    # its declared sha256 is the original's


def test_chunk_faults_fail_their_row_with_the_reason_and_nothing_else(kafka):
    """One partition. Group ``expired``: its chunks are deleted (delete_records) before the
    trainer fetches. Group ``faults``: row 0 fine, row 1 lost (its reference names an offset past
    the log's end), row 2 duplicated (an extra copy of each chunk; the reference names one),
    row 3 reordered (its calls' chunks produced interleaved, last call first), row 4 corrupt (a
    flipped byte in transit, declared digest intact), row 5 mismatched (a chunk offset of
    another call)."""
    topics = unique_topics()
    setup_topics(stage_config(kafka.bootstrap, topics), partitions=1)
    writer = _writer(kafka, topics)
    expired = make_group("expired", 2, calls=2, seed=7, routes=(L, K))
    faults = make_group("faults", 6, calls=3, seed=8, routes=(L, K))
    staged = {"expired": [writer.stage(v, CHUNK) for v in expired.staged]}
    end_of_expired = max(c["offset"] for v in staged["expired"] for c in v["routes_ref"]["chunks"]) + 1

    calls = {}
    for value in faults.staged:
        calls.setdefault(int(value["staging_key"].split("-r")[1].split("/")[0]), []).append(value)
    out = []
    for row, values in sorted(calls.items()):
        if row == 2:                                    # duplicated: each chunk written twice
            for value in values:
                chunks = route_chunks(value, CHUNK)
                landed = writer.write(value["group_id"], chunks + chunks)
                out.append(by_reference(value, reference(value, chunks, [o for _, o in landed[:len(chunks)]],
                                                         partition=0, topic=topics.staged_routes)))
        elif row == 3:                                  # reordered: calls interleaved, last first
            pieces = [(value, route_chunks(value, CHUNK)) for value in reversed(values)]
            order = [(v, i, c) for step in range(max(len(cs) for _, cs in pieces))
                     for v, cs in pieces for i, c in enumerate(cs) if i == step]
            landed = writer.write(values[0]["group_id"], [c for _, _, c in order])
            offsets = {}
            for (v, i, _c), (_p, offset) in zip(order, landed):
                offsets.setdefault(v["staging_key"], {})[i] = offset
            for value in values:
                chunks = route_chunks(value, CHUNK)
                at = offsets[value["staging_key"]]
                out.append(by_reference(value, reference(value, chunks, [at[i] for i in range(len(chunks))],
                                                         partition=0, topic=topics.staged_routes)))
        elif row == 4:                                  # corrupt: the last call's first chunk
            for j, value in enumerate(values):
                chunks = route_chunks(value, CHUNK)
                sent = [_flip(c) if j == len(values) - 1 and i == 0 else c for i, c in enumerate(chunks)]
                landed = writer.write(value["group_id"], sent)
                out.append(by_reference(value, reference(value, chunks, [o for _, o in landed],
                                                         partition=0, topic=topics.staged_routes)))
        else:
            out.extend(writer.stage(value, CHUNK) for value in values)
    by_key = {v["staging_key"]: v for v in out}
    lost = by_key["faults-r1/c1"]["routes_ref"]["chunks"]
    lost[-1]["offset"] = 1_000_000                      # no chunk there: past the log's end
    mismatched = by_key["faults-r5/c0"]["routes_ref"]["chunks"]
    other = by_key["faults-r0/c0"]["routes_ref"]["chunks"][0]   # written before: a lower offset
    mismatched[0]["offset"] = other["offset"]
    staged["faults"] = [by_key[v["staging_key"]] for v in faults.staged]

    assigned, _ = _run_stage(kafka, topics, [expired, faults], staged)
    assert topics.staged_routes not in assigned
    groups = _groups(kafka, topics, 2)
    assert all(row.valid for g in groups.values() for row in g.rows)   # the stage read no chunk

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for future in admin.delete_records([TopicPartition(topics.staged_routes, 0, end_of_expired)]).values():
        future.result(30)

    expect = {("faults", 0): None, ("faults", 1): "chunk_missing", ("faults", 2): None,
              ("faults", 3): None, ("faults", 4): "chunk_corrupt", ("faults", 5): "chunk_mismatch",
              ("expired", 0): "chunk_missing", ("expired", 1): "chunk_missing"}
    with DeferredRouteFetcher(kafka.bootstrap, dims=(L, K), config=CLIENT, timeout=5.0) as fetcher:
        for spec in (faults, expired):
            group = groups[spec.group_id]
            routes = fetcher.attach(group)
            for index, (got, want) in enumerate(zip(routes, expected_rows(spec, DIRECT))):
                reason = expect[(spec.group_id, index)]
                if reason is None:
                    assert torch.equal(got, _unpack(want["routed_experts"])), (spec.group_id, index)
                else:
                    assert got.shape == _unpack(want["routed_experts"]).shape and got.eq(-1).all()
        assert fetcher.failures == {"chunk_missing": 3, "chunk_corrupt": 1, "chunk_mismatch": 1}
        # one row at a time: each failing row's own reason
        for (group_id, index), reason in expect.items():
            before = dict(fetcher.failures)
            fetcher.routes(groups[group_id].plans[index])
            grown = {k: v - before.get(k, 0) for k, v in fetcher.failures.items() if v != before.get(k, 0)}
            assert grown == ({} if reason is None else {reason: 1}), (group_id, index, grown)
    # one run over expired and live chunks (the expired group's end where the other's begin):
    # the deleted ones are missing, the rest is read from the log's new start
    with DeferredRouteFetcher(kafka.bootstrap, dims=(L, K), config=CLIENT, timeout=5.0) as fetcher:
        wants = fetcher.wants_of(groups["expired"].plans + groups["faults"].plans[:1])
        got = fetcher.fetch_chunks(wants)
        reasons = {w.staging_key: getattr(got[key], "reason", "ok") for key, w in wants.items()}
        assert {r for k, r in reasons.items() if k.startswith("expired")} == {"chunk_missing"}
        assert {r for k, r in reasons.items() if k.startswith("faults")} == {"ok"}
        assert all("deleted or expired" in str(got[key]) for key, w in wants.items()
                   if w.staging_key.startswith("expired"))


def test_a_corrupt_chunk_is_named_in_the_log(kafka, caplog):
    topics = unique_topics()
    setup_topics(stage_config(kafka.bootstrap, topics), partitions=1)
    writer = _writer(kafka, topics)
    spec = make_group("named", 1, calls=1, seed=3, routes=(L, K), generated=12)
    value = spec.staged[0]
    chunks = route_chunks(value, CHUNK)
    assert len(chunks) >= 3
    landed = writer.write(value["group_id"], [_flip(c) if i == 1 else c for i, c in enumerate(chunks)])
    staged = {"named": [by_reference(value, reference(value, chunks, [o for _, o in landed], partition=0,
                                                      topic=topics.staged_routes))]}
    _run_stage(kafka, topics, [spec], staged)
    group = _groups(kafka, topics, 1)["named"]
    with DeferredRouteFetcher(kafka.bootstrap, dims=(L, K), config=CLIENT, timeout=5.0) as fetcher:
        with caplog.at_level("ERROR", logger="stage.client.route_fetch"):
            assert fetcher.routes(group.plans[0]).eq(-1).all()
    assert fetcher.failures == {"chunk_corrupt": 1}
    assert f"chunk 1 at {topics.staged_routes}[0]@{landed[1][1]}" in caplog.text
    assert f"chunk 0 at" not in caplog.text and "chunk 2 at" not in caplog.text
