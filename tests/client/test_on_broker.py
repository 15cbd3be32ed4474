"""SDK, reader and deferred route fetch against a broker (the real one and Tansu)."""

import numpy as np
import pytest
import torch

from stage.buffer import Position
from stage.client import (
    CanonicalReader,
    DeferredRouteFetcher,
    RolloutStager,
    StagingProducer,
    TrainingGroup,
    row_from_record,
)
from stage.finalize import GroupFinalizer, InMemoryTokenSource, ReassemblyConfig
from stage.publish.records import plan_record, row_record
from stage.wire import AvroCodec
from tests.integration.harness import setup_topics, stage_config, unique_topics

L, K = 3, 2
CLIENT = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "fetch.wait.max.ms": 20}
ROWS = AvroCodec("CanonicalRow")


@pytest.fixture(params=["tansu", "kafka"])
def broker(request):
    return request.getfixturevalue(request.param)


def _topics(broker):
    topics = unique_topics()
    setup_topics(stage_config(broker.bootstrap, topics), partitions=2)
    return topics


def _stage_group(producer, group_id, n=2, turns=3, seed=0):
    """n rollouts staged through the SDK; returns (records, receipts, coordinates by key)."""
    rng = np.random.default_rng(seed)
    coords, records, receipts = {}, [], []
    for i in range(n):
        stager = RolloutStager(producer, group_id, f"{group_id}-r{i}")
        parent = None
        for t in range(turns):
            carry, gen = (5 if parent is None else 2), 3
            prepared = stager.prepare(
                f"c{t}", parent_call_id=parent, prompt_delta=rng.integers(1, 999, carry),
                generated=rng.integers(1, 999, gen), generated_logprobs=-rng.random(gen).astype(np.float32),
                weight_version=3, routed_experts=rng.integers(0, 64, (carry + gen, L, K)),
                routed_experts_boundary=None if parent is None else rng.integers(0, 64, (1, L, K)))
            key = prepared.staging_key
            producer.send_staged(group_id, prepared.value, on_delivery=lambda d, key=key: coords.__setitem__(
                key, Position(d.topic, d.partition, d.offset, 0)))
            records.append(prepared.record)
            parent = f"c{t}"
        receipts.append(stager.receipt().to_json())
    producer.flush(60)
    return records, receipts, coords


def _finalize(group_id, records, receipts, config):
    source = InMemoryTokenSource()
    for record in records:
        source.stage(record)
    n = len(receipts)
    return GroupFinalizer(source, config).finalize_group(
        group_id, [f"{group_id}-r{i}" for i in range(n)], receipts, [1.0] * n, mask_sample=[False] * n,
        fallback_weight_version=0, prompt_idx=0)


def test_deferred_plans_fetch_fragments_by_coordinates_and_rebuild_the_direct_routes(broker):
    topics = _topics(broker)
    producer = StagingProducer(broker.bootstrap, topics=topics, routes_by_reference=False)   # inline fragments
    records, receipts, coords = _stage_group(producer, "fetch")
    assert all(p.partition == coords["fetch-r0/c0"].partition for p in coords.values())  # keyed by group
    deferred = _finalize("fetch", records, receipts, ReassemblyConfig(router_replay=True, defer_routes=True))
    direct = _finalize("fetch", records, receipts, ReassemblyConfig(router_replay=True))
    plans = [plan_record(row, coords) for row in deferred.rows]
    group = TrainingGroup("fetch", [row_from_record(ROWS.decode(ROWS.encode(row_record(r)))) for r in deferred.rows],
                          [row_record(r) for r in deferred.rows], plans)
    # timeout: Tansu neither fails nor ends a fetch beyond the log end, it just returns nothing
    with DeferredRouteFetcher(broker.bootstrap, dims=(L, K), config=CLIENT, timeout=3.0) as fetcher:
        routes = fetcher.attach(group)
        assert fetcher.failures == {} and fetcher.fetched == len(coords)
        for got, want in zip(routes, direct.rows):
            assert got.dtype == torch.int16 and torch.equal(got, want.routed_experts)
        assert torch.equal(group.tensors()["routed_experts"], direct.routed_experts)

        # the wrong record at a span's coordinates, or none at all: all -1, and counted
        wrong = coords["fetch-r0/c1"]
        spans = plans[0]["spans"]
        moved = {**plans[0], "spans": [dict(spans[0], fragment={**spans[0]["fragment"], "offset": wrong.offset}),
                                        *spans[1:]]}
        beyond = {**plans[0], "spans": [dict(spans[0], fragment={**spans[0]["fragment"], "offset": 10_000}),
                                         *spans[1:]]}
        for plan in (moved, beyond):
            out = fetcher.routes(plan)
            assert out.shape == (plan["expected_token_length"], L, K) and out.eq(-1).all()
        assert fetcher.failures == {"missing_fragment": 2}
    with DeferredRouteFetcher(broker.bootstrap, dims=(L + 1, K), config=CLIENT) as other_model:
        assert other_model.routes(plans[0]).eq(-1).all()
        assert other_model.failures == {"fragment_model_shape": 1}


def test_the_fetcher_verifies_a_fragment_once_and_keeps_its_cache_within_its_byte_budget(kafka):
    topics = _topics(kafka)
    producer = StagingProducer(kafka.bootstrap, topics=topics, routes_by_reference=False)    # inline fragments
    records, receipts, coords = _stage_group(producer, "cache", n=2, turns=3)
    deferred = _finalize("cache", records, receipts, ReassemblyConfig(router_replay=True, defer_routes=True))
    direct = _finalize("cache", records, receipts, ReassemblyConfig(router_replay=True))
    plans = [plan_record(row, coords) for row in deferred.rows]
    spans = sum(1 for plan in plans for s in plan["spans"] if s["fragment"] is not None)

    def group():
        return TrainingGroup("cache", [row_from_record(ROWS.decode(ROWS.encode(row_record(r))))
                                       for r in deferred.rows], [row_record(r) for r in deferred.rows], plans)

    with DeferredRouteFetcher(kafka.bootstrap, dims=(L, K), config=CLIENT, verify_threads=1) as fetcher:
        first = fetcher.attach(group())
        assert (fetcher.fetched, fetcher.verified, fetcher.verified_cached) == (spans, spans, 0)
        again = fetcher.attach(group())          # cache hits: nothing read, nothing re-hashed
        assert (fetcher.fetched, fetcher.verified, fetcher.verified_cached) == (spans, spans, spans)
        for a, b, want in zip(first, again, direct.rows):
            assert torch.equal(a, want.routed_experts) and torch.equal(b, want.routed_experts)
    with DeferredRouteFetcher(kafka.bootstrap, dims=(L, K), config=CLIENT, verify_threads=3) as threaded:
        for _ in range(2):                       # checked ahead on threads, still once each
            assert all(torch.equal(r, w.routed_experts) for r, w in zip(threaded.attach(group()), direct.rows))
        assert (threaded.fetched, threaded.verified, threaded.failures) == (spans, spans, {})
        # each fragment is handed over as soon as it is at hand (decoded or a cache hit), once,
        # before fetch returns: what lets attach hash it while the next records are read
        wanted = [(s["fragment"]["topic"], s["fragment"]["partition"], s["fragment"]["offset"])
                  for plan in plans for s in plan["spans"] if s["fragment"] is not None]
        seen = []
        threaded.cache.clear()
        threaded.cached_bytes = 0
        fetched = threaded.fetch(wanted, on_fragment=lambda c, entry: seen.append((c, entry)))
        assert sorted(c for c, _ in seen) == sorted(set(wanted))
        assert all(fetched[c] is entry for c, entry in seen)
        hits = []
        threaded.fetch(wanted, on_fragment=lambda c, entry: hits.append(c))
        assert sorted(hits) == sorted(set(wanted)) and threaded.fetched == 2 * spans
        entry = next(iter(fetcher.cache.values()))
        assert fetcher.cached_bytes == sum(e.nbytes for e in fetcher.cache.values())
        # the entry holds the route bytes, not the record: a fragment and its boundary only
        assert entry.nbytes < entry.fragment.routes.nbytes + 2048 + 64

    budget = 2 * max(e.nbytes for e in fetcher.cache.values())
    with DeferredRouteFetcher(kafka.bootstrap, dims=(L, K), config=CLIENT, cache_bytes=budget) as small:
        routes = small.attach(group())
        assert small.cached_bytes <= budget and 0 < len(small.cache) <= 2
        assert small.failures == {} and all(torch.equal(r, w.routed_experts) for r, w in zip(routes, direct.rows))
    with DeferredRouteFetcher(kafka.bootstrap, dims=(L, K), config=CLIENT, cache_bytes=0) as none:
        assert [torch.equal(r, w.routed_experts) for r, w in zip(none.attach(group()), direct.rows)] == [True, True]
        assert none.cache == {} and none.cached_bytes == 0


def test_reader_assembles_groups_from_the_topic_and_drops_duplicate_sample_ids(broker):
    topics = _topics(broker)
    producer = StagingProducer(broker.bootstrap, topics=topics)
    groups = {}
    for gid, seed in (("ga", 1), ("gb", 2)):
        records, receipts, _ = _stage_group(producer, gid, n=3, turns=2, seed=seed)
        groups[gid] = _finalize(gid, records, receipts, ReassemblyConfig(router_replay=True))
    blobs = {gid: [ROWS.encode(row_record(r)) for r in g.rows] for gid, g in groups.items()}
    # interleaved, with a replayed copy of two rows (what an aborted transaction shows on Tansu)
    order = [("ga", 0), ("gb", 2), ("ga", 0), ("ga", 2), ("gb", 0), ("gb", 2), ("gb", 1), ("ga", 1)]
    for gid, i in order:
        producer.produce(topics.canonical_rows, gid, blobs[gid][i])
    producer.flush(60)
    with CanonicalReader(broker.bootstrap, topics=topics, config=CLIENT) as reader:
        got = {g.group_id: g for g in reader.read(2, timeout=60)}
        assert sorted(got) == ["ga", "gb"]
        assert reader.counts["duplicates"] == 2 and reader.counts["groups"] == 2
        for gid, group in got.items():
            assert [r.sample_id for r in group.rows] == [f"{gid}_g{i}" for i in range(3)]
            assert [ROWS.encode(rec) for rec in group.records] == blobs[gid]
            assert torch.equal(group.tensors()["routed_experts"], groups[gid].routed_experts)


def test_a_group_member_reader_commits_only_what_it_handed_out(kafka):
    topics = _topics(kafka)
    producer = StagingProducer(kafka.bootstrap, topics=topics)
    records, receipts, _ = _stage_group(producer, "gc", n=2, turns=1)
    rows = [ROWS.encode(row_record(r)) for r in _finalize("gc", records, receipts, ReassemblyConfig()).rows]
    records2, receipts2, _ = _stage_group(producer, "gd", n=2, turns=1, seed=3)
    rows2 = [ROWS.encode(row_record(r)) for r in _finalize("gd", records2, receipts2, ReassemblyConfig()).rows]
    for gid, blob in (("gc", rows[0]), ("gc", rows[1]), ("gd", rows2[0])):   # gd stays incomplete
        producer.produce(topics.canonical_rows, gid, blob)
    producer.flush(60)
    member = f"trainer-{topics.receipts}"
    with CanonicalReader(kafka.bootstrap, topics=topics, group_id=member, config=CLIENT) as reader:
        assert [g.group_id for g in reader.read(1, timeout=60)] == ["gc"]
        reader.read(1, timeout=2)                     # gd's first row arrives, the group is incomplete
        assert reader.assembler.pending.keys() == {"gd"}
        reader.commit()
    producer.produce(topics.canonical_rows, "gd", rows2[1])
    producer.flush(60)
    with CanonicalReader(kafka.bootstrap, topics=topics, group_id=member, config=CLIENT) as again:
        got = again.read(1, timeout=60)
        assert [g.group_id for g in got] == ["gd"]    # re-read from gd's first row, gc not again
        again.read(1, timeout=2)
        assert again.counts["groups"] == 1 and again.counts["rows"] == 2



def _produce_located(producer, topic, key, blob) -> tuple[int, int]:
    """Produce one record and return its (partition, offset)."""
    where = []
    producer.produce(topic, key, blob, on_delivery=lambda d: where.append((d.partition, d.offset)))
    producer.flush(60)
    return where[0]


def test_a_row_the_reader_cannot_decode_stops_it_and_the_position_never_passes_it(kafka):
    """It was counted ``undecodable`` and skipped: the position moved past it and a
    checkpointing trainer lost the group for good."""
    from stage.client.reader import UnreadableRecord

    topics = _topics(kafka)
    producer = StagingProducer(kafka.bootstrap, topics=topics)
    records, receipts, _ = _stage_group(producer, "good", n=2, turns=1)
    for row in _finalize("good", records, receipts, ReassemblyConfig()).rows:
        _produce_located(producer, topics.canonical_rows, "good", ROWS.encode(row_record(row)))
    partition, bad_offset = _produce_located(producer, topics.canonical_rows, "bad", b"\x00not a row")
    records, receipts, _ = _stage_group(producer, "bad", n=1, turns=1, seed=4)
    (after,) = _finalize("bad", records, receipts, ReassemblyConfig()).rows
    _produce_located(producer, topics.canonical_rows, "bad", ROWS.encode(row_record(after)))
    with CanonicalReader(kafka.bootstrap, topics=topics, config=CLIENT) as reader:
        with pytest.raises(UnreadableRecord, match=rf"rows record at .*\[{partition}\]@{bad_offset} cannot be "
                                                   r"read: .*create the reader with max_record_bytes="):
            while True:
                reader.read(5, timeout=60)
        position = reader.position()
        resume = position.offsets()[(topics.canonical_rows, partition)]
        assert resume is None or resume <= bad_offset          # None: from the beginning
        with pytest.raises(UnreadableRecord):                 # stays stopped
            reader.read(1, timeout=1)
    with CanonicalReader(kafka.bootstrap, topics=topics, config=CLIENT, start_from=position) as again:
        with pytest.raises(UnreadableRecord, match=rf"@{bad_offset} "):   # stops there again
            while True:
                again.read(5, timeout=60)


def test_one_setting_lets_the_reader_read_rows_above_the_default_cap_and_names_itself_when_short(kafka):
    from stage.client.reader import UnreadableRecord

    topics = _topics(kafka)
    producer = StagingProducer(kafka.bootstrap, topics=topics)
    records, receipts, _ = _stage_group(producer, "big", n=1, turns=2)
    (row,) = _finalize("big", records, receipts, ReassemblyConfig()).rows
    blob = ROWS.encode(row_record(row))
    _produce_located(producer, topics.canonical_rows, "big", blob)
    with CanonicalReader(kafka.bootstrap, topics=topics, config=CLIENT, max_record_bytes=len(blob) - 1) as short:
        with pytest.raises(UnreadableRecord, match=f"exceeds max_record_bytes={len(blob) - 1}"):
            short.read(1, timeout=60)
    with CanonicalReader(kafka.bootstrap, topics=topics, config=CLIENT, max_record_bytes=len(blob)) as fits:
        assert [g.group_id for g in fits.read(1, timeout=60)] == ["big"]
