"""``rollout-reassembler bench fetch``: the trainer side of deferred router replay.

One group of the profile is staged on a broker; the stage's deferred finalization (run here, on
the same records and their real coordinates) gives its RoutePlans; then ``DeferredRouteFetcher``
rebuilds every row's routes (``attach``): cold (fragments fetched by coordinates, decoded,
integrity-checked, assembled), then again from its cache (no fetch, no re-verification). Anchors
measured in the same run: a raw consume of the same records (a plain consumer, values touched,
nothing decoded) and base64 + SHA-256 of the route bytes (what the integrity check must hash).

``routes="by-reference"``: each call's routes are written as RouteChunk records to a route
topic first (``DEFAULT_ROUTE_CHUNK_BYTES`` a chunk, all acknowledged before any staged call:
claim-check order), the staged calls carry the references, and the plans name the chunks; the
fetcher reads only those chunks. The anchors are then a raw consume of the route topic (the
same route bytes) and the hashing (SHA-256 of each chunk; base64 + SHA-256 of each call's
routes, what the extras digest costs).
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
import uuid

import pybase64
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from stage.bench import pipeline as P
from stage.bench.broker import produce
from stage.bench.inputs import BENCH_MAX_RECORD_BYTES, RECEIPTS, bench_profile, fixed_group
from stage.bench.inputs import profile_groups, profile_line
from stage.bench.machine import machine_info, machine_line
from stage.buffer import PartitionBuffer, Position
from stage.client.consuming import fetch_limits, take
from stage.decode import InputLimits, receipt_item, staged_item
from stage.staging.route_refs import DEFAULT_ROUTE_CHUNK_BYTES, ChunkRef, RouteReference, chunk_sha256, chunk_value, split_payload
from stage.wire import DEFAULT_MAX_RECORD_BYTES, AvroCodec, TopicNames


def _group(profile: str):
    if profile == "default":
        line = "profile default: N=8 x 32 calls x 512 tokens, routes L=48 K=8 int16 (96 MiB a group)"
        return line, fixed_group(), (48, 8)
    cfg = bench_profile(profile, groups=1)
    return profile_line(profile, cfg), next(profile_groups(cfg, 1)), cfg.routes


def _stage_records(bootstrap: str, topic: str, inputs) -> dict[int, Position]:
    """Produce the staged calls to a fresh one-partition topic; index -> where it landed."""
    admin = AdminClient({"bootstrap.servers": bootstrap})   # kept alive until the topic exists
    admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": str(BENCH_MAX_RECORD_BYTES)})]
                        )[topic].result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "acks": "all",
                         "message.max.bytes": BENCH_MAX_RECORD_BYTES})
    where: dict[int, Position] = {}
    for index, (role, value) in enumerate(inputs.records):
        if role == RECEIPTS:
            continue
        produce(producer, topic, key=inputs.group_id.encode(), value=value, on_delivery=(
            lambda i: lambda err, msg: where.__setitem__(i, Position(msg.topic(), msg.partition(),
                                                                     msg.offset(), 0)))(index))
        producer.poll(0)
    producer.flush(120)
    return where


def _create(bootstrap: str, *topics: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(t, 1, 1, config={"max.message.bytes": str(BENCH_MAX_RECORD_BYTES)})
                                   for t in topics])
    for future in futures.values():
        future.result(30)


def _stage_by_reference(bootstrap: str, topic: str, route_topic: str, inputs,
                        chunk_bytes: int = DEFAULT_ROUTE_CHUNK_BYTES):
    """Every call's routes as chunks on ``route_topic`` (all acknowledged first), then the
    staged calls naming them on ``topic``: (records with the by-reference values, index ->
    where each staged call landed, the chunks' data)."""
    _create(bootstrap, topic, route_topic)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "acks": "all",
                         "message.max.bytes": BENCH_MAX_RECORD_BYTES})
    staged_codec = AvroCodec("StagedCall", max_record_bytes=BENCH_MAX_RECORD_BYTES)
    chunk_codec = AvroCodec("RouteChunk", max_record_bytes=BENCH_MAX_RECORD_BYTES)
    key = inputs.group_id.encode()
    decoded, landed, datas = {}, {}, []
    for index, (role, value) in enumerate(inputs.records):
        if role == RECEIPTS:
            continue
        record = decoded[index] = staged_codec.decode(value)
        if record["routed_experts"] is None:
            continue
        pieces = split_payload(record["routed_experts"]["data"], chunk_bytes)
        landed[index] = [None] * len(pieces)
        for i, piece in enumerate(pieces):
            chunk = chunk_value(record["group_id"], record["staging_key"], i, len(pieces), piece)
            datas.append(chunk["data"])
            produce(producer, route_topic, key=key, value=chunk_codec.encode(chunk), on_delivery=(
                lambda at, i: lambda err, msg: at.__setitem__(i, (msg.partition(), msg.offset())))(
                    landed[index], i))
            producer.poll(0)
    producer.flush(120)   # claim-check: every chunk acknowledged before a call names it
    records, where = [], {}
    for index, (role, value) in enumerate(inputs.records):
        if role != RECEIPTS:
            record = decoded[index]
            if index in landed:
                routes = record["routed_experts"]
                pieces = split_payload(routes["data"], chunk_bytes)
                ref = RouteReference(route_topic, landed[index][0][0], routes["dtype"], tuple(routes["shape"]),
                                     tuple(ChunkRef(offset, len(piece), chunk_sha256(piece))
                                           for (_p, offset), piece in zip(landed[index], pieces)))
                record["routed_experts"], record["routes_ref"] = None, ref.to_value()
                value = staged_codec.encode(record)
            produce(producer, topic, key=key, value=value, on_delivery=(
                lambda i: lambda err, msg: where.__setitem__(i, Position(msg.topic(), msg.partition(),
                                                                         msg.offset(), 0)))(index))
            producer.poll(0)
        records.append((role, value))
    producer.flush(120)
    return records, where, datas


def _plans_and_rows(inputs, where: dict[int, Position], records=None, route_topic: str | None = None):
    """The stage's deferred outputs for the group, with the records' real coordinates
    (``records``: the group's records as staged, default ``inputs.records``)."""
    codec_map = P.codecs()
    buffer = PartitionBuffer(0, receipts_topic="receipts", staged_topic=where[min(where)].topic,
                             group_timeout_ms=1 << 40, late_retention_ms=1000)
    for index, (role, value) in enumerate(inputs.records if records is None else records):
        if role == RECEIPTS:
            buffer.add_receipt(receipt_item(codec_map["ReceiptEvent"].decode(value),
                                            Position("receipts", 0, index, 1), len(value)), 1)
        else:
            buffer.add_staged(staged_item(codec_map["StagedCall"].decode(value), where[index], len(value),
                                          InputLimits(), keep_routes=False), 1)
    if route_topic is None:
        out = P.finalize(buffer.groups[inputs.group_id], "deferred", codec_map)
    else:   # the stage's route topic is this run's
        from stage.routes import RouteDimsCache
        from stage.runtime.task.finalize_task import finalize_and_encode
        out = finalize_and_encode(buffer.groups[inputs.group_id], "complete", 0, config=P.config_for("deferred"),
                                  dims_cache=RouteDimsCache(), codecs=codec_map,
                                  topics=TopicNames(staged_routes=route_topic), limits=InputLimits(),
                                  now_ms=lambda: 0)
        if out.error is not None or out.valid_rows != out.total_rows:
            raise RuntimeError(f"a clean benchmark group did not finalize: {out.error or out.rejections}")
    rows = [codec_map["CanonicalRow"].decode(v) for t, v in out.records if t == P.TOPICS.canonical_rows]
    plans = [codec_map["RoutePlan"].decode(v) for t, v in out.records if t == P.TOPICS.route_plans]
    return rows, plans


def _raw_consume_seconds(bootstrap: str, topic: str, count: int, max_record_bytes: int) -> float:
    """A plain consumer with the fetcher's fetch limits (stage.client.consuming.fetch_limits)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"raw-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 10,
                         **fetch_limits(max_record_bytes)})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        started, seen, touched = time.perf_counter(), 0, 0
        while seen < count:
            for msg in take(consumer, 500, 1.0):   # what is fetched, else wait for the first
                if msg.error() is None:
                    touched += len(msg.value())   # the value as Python bytes, as a reader gets it
                    seen += 1
        return time.perf_counter() - started
    finally:
        consumer.close()


def run(*, bootstrap: str | None = None, profile: str = "default", as_json: bool = False,
        cache_bytes: int = 1 << 30, routes: str = "inline") -> dict:
    import logging

    from stage.client import DeferredRouteFetcher, TrainingGroup, row_from_record
    # calls staged without a boundary sidecar: the plan builder's legacy warning, once per call
    logging.getLogger("stage.routes.builder").setLevel(logging.ERROR)
    broker = None
    if bootstrap is None:
        from stage.brokers.kraft import KraftBroker, jars_available
        if not jars_available():
            raise RuntimeError("no --bootstrap-servers and no local Kafka jars (make kafka-jars)")
        broker = KraftBroker().start()
        bootstrap = broker.bootstrap
    try:
        load_before = P.load_average()
        line, inputs, dims = _group(profile)
        topic = f"bench-fetch-{uuid.uuid4().hex[:8]}"
        chunk_sha_s = None
        # the record cap both readers get: the default, or what the largest staged call needs
        cap = max(DEFAULT_MAX_RECORD_BYTES, *(len(v) for role, v in inputs.records if role != RECEIPTS))
        if routes == "by-reference":
            route_topic = f"{topic}-routes"
            records, where, chunk_datas = _stage_by_reference(bootstrap, topic, route_topic, inputs)
            rows, plans = _plans_and_rows(inputs, where, records, route_topic)
            route_payloads = _route_payloads(inputs.records, ("routed_experts",))
            raw_s = min(_raw_consume_seconds(bootstrap, route_topic, len(chunk_datas), cap) for _ in range(2))
            chunk_sha_s = P.best_seconds(lambda: [hashlib.sha256(d).digest() for d in chunk_datas], 2)
            del chunk_datas, records
        else:
            where = _stage_records(bootstrap, topic, inputs)
            rows, plans = _plans_and_rows(inputs, where)
            route_payloads = _route_payloads(inputs.records, ("routed_experts", "routed_experts_boundary"))
            raw_s = min(_raw_consume_seconds(bootstrap, topic, len(where), cap) for _ in range(2))
        route_bytes = sum(len(p) for p in route_payloads)
        b64_s = P.best_seconds(lambda: [hashlib.sha256(pybase64.b64encode(p)).digest() for p in route_payloads], 2)
        del route_payloads

        def group():
            return TrainingGroup(inputs.group_id, [row_from_record(r) for r in rows], rows, plans)

        gc.collect()
        rss_before = P.rss_bytes()
        fetcher = DeferredRouteFetcher(bootstrap, dims=dims, cache_bytes=cache_bytes,
                                       config={"fetch.wait.max.ms": 10}, max_record_bytes=cap)
        try:
            started = time.perf_counter()
            fetcher.attach(group())
            cold_s = time.perf_counter() - started
            fetched, verified = fetcher.fetched + fetcher.chunks_fetched, fetcher.verified
            started = time.perf_counter()
            fetcher.attach(group())
            warm_s = time.perf_counter() - started
            gc.collect()
            rss_held = P.rss_bytes() - rss_before
            report = {
                "benchmark": "fetch", "routes": routes, "profile": profile, "profile_line": line,
                "chunk_sha256_s": chunk_sha_s,
                "load_before": load_before, "load_after": P.load_average(), "machine": machine_info(),
                "rows": len(rows), "fragments": fetched, "route_bytes": route_bytes, "max_record_bytes": cap,
                "raw_consume_s": raw_s, "base64_sha256_s": b64_s,
                "cold_s": cold_s, "cold_mb_per_s": route_bytes / cold_s / 1e6,
                "warm_s": warm_s, "warm_mb_per_s": route_bytes / warm_s / 1e6,
                "cold_to_raw_consume": cold_s / raw_s, "cold_to_raw_plus_hash": cold_s / (raw_s + b64_s),
                "integrity_checks": {"cold": verified, "warm_new": fetcher.verified - verified,
                                     "warm_from_cache": fetcher.verified_cached},
                "failures": dict(fetcher.failures), "cache_bytes": cache_bytes,
                "cached_bytes": fetcher.cached_bytes, "rss_held_bytes": rss_held,
            }
        finally:
            fetcher.close()
    finally:
        if broker is not None:
            broker.discard()
    print(json.dumps(report, indent=2) if as_json else render(report))
    return report


def _route_payloads(records, fields) -> list[bytes]:
    staged_codec = AvroCodec("StagedCall", max_record_bytes=BENCH_MAX_RECORD_BYTES)
    out = []
    for role, value in records:
        if role != RECEIPTS:
            record = staged_codec.decode(value)
            out += [record[n]["data"] for n in fields if record[n] is not None]
    return out


def render(r: dict) -> str:
    mb = r["route_bytes"] / 1e6
    by_ref = r.get("routes") == "by-reference"
    what = "route chunks" if by_ref else "fragments"
    source = "the route topic (the same route bytes)" if by_ref else "the records"
    chunk_hash = (f", SHA-256 of the chunks {r['chunk_sha256_s']:.2f} s" if r.get("chunk_sha256_s") is not None
                  else "")
    return "\n".join([
        f"bench fetch ({r.get('routes', 'inline')}): {r['profile_line']}; machine load {r['load_before']}",
        machine_line(r["machine"]),
        f"group: {r['rows']} rows, {r['fragments']} {what}, {mb:,.1f} MB of routes",
        f"anchors: raw consume of {source} {r['raw_consume_s']:.2f} s ({mb / r['raw_consume_s']:,.0f} MB/s), "
        f"base64 + SHA-256 of the routes {r['base64_sha256_s']:.2f} s{chunk_hash}",
        f"cold attach (fetch + decode + verify + assemble): {r['cold_s']:.2f} s = {r['cold_mb_per_s']:,.0f} MB/s "
        f"({r['cold_to_raw_consume']:.2f}x the raw consume, {r['cold_to_raw_plus_hash']:.2f}x raw consume + "
        f"hashing); target >= 500 MB/s",
        f"warm attach (cache): {r['warm_s']:.2f} s = {r['warm_mb_per_s']:,.0f} MB/s; integrity checks: "
        f"{r['integrity_checks']['cold']} cold, {r['integrity_checks']['warm_new']} new when warm, "
        f"{r['integrity_checks']['warm_from_cache']} answered from the cache",
        f"cache: {r['cached_bytes'] / 1e6:,.1f} MB held of a {r['cache_bytes'] / 2**20:,.0f} MiB budget; "
        f"RSS held after both attaches: {r['rss_held_bytes'] / 1e6:,.1f} MB; failures {r['failures'] or 'none'}",
        f"machine load after: {r['load_after']}",
    ])
