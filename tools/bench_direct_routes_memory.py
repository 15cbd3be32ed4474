"""The stage's (peak - idle) RSS in direct router replay with routes staged by reference.

As ``rollout-reassembler bench memory --open all``, with the issue 26 workload: ``--groups``
groups of 16 rollouts x 8 chained calls x 1,024 tokens with 48x8 int16 routes (~100 MB a
group, ``stage.bench.inputs.fixed_group``), each call's routes written to the route topic
first (chunks of ``DEFAULT_ROUTE_CHUNK_BYTES``, acknowledged) and the staged call naming them
by offset; every group's staged calls before any receipt (all groups open at once). The stage
runs as its own process (``rollout-reassembler run``) at ``max_buffered_bytes = --cap-mib``;
its RSS is sampled every 50 ms. ``--inline`` sends the same calls with their routes inline
(the path before routes by reference) for comparison.

    .venv/bin/python tools/bench_direct_routes_memory.py --groups 24 --cap-mib 512
"""

from __future__ import annotations

import argparse
import time
import uuid

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from stage.bench.broker import bench_broker, produce
from stage.bench.e2e import StageProcess, _config, _topics
from stage.bench.inputs import BENCH_MAX_RECORD_BYTES, RECEIPTS, fixed_group
from stage.bench.machine import machine_info, machine_line
from stage.bench.memory import Sampler, _gauge, _rss_bytes, _summaries
from stage.runtime.kafka.topics import create_topics
from stage.staging.route_refs import DEFAULT_ROUTE_CHUNK_BYTES, chunk_value, split_payload
from stage.wire import AvroCodec
from stage.wire.partitioner import LIBRDKAFKA_PARTITIONER


def by_reference(producer, topics, group_id: str, value: dict, chunk_codec) -> dict:
    tensor = value["routed_experts"]
    pieces = split_payload(tensor["data"], DEFAULT_ROUTE_CHUNK_BYTES)
    landed: dict[int, tuple[int, int]] = {}
    chunks = [chunk_value(group_id, value["staging_key"], i, len(pieces), p) for i, p in enumerate(pieces)]
    for i, chunk in enumerate(chunks):
        def delivered(err, msg, i=i):
            assert err is None, err
            landed[i] = (msg.partition(), msg.offset())
        produce(producer, topics.staged_routes, key=group_id.encode(), value=chunk_codec.encode(chunk),
                on_delivery=delivered)
    while len(landed) < len(chunks):     # claim-check order: acknowledged before the reference
        producer.poll(0.05)
    ref = {"topic": topics.staged_routes, "partition": landed[0][0], "dtype": tensor["dtype"],
           "shape": list(tensor["shape"]),
           "chunks": [{"offset": landed[i][1], "length": len(c["data"]), "sha256": c["sha256"]}
                      for i, c in enumerate(chunks)]}
    return {**value, "routed_experts": None, "routes_ref": ref}


def trace(stage, path: str, stop) -> None:
    """Every 0.25 s: seconds, RSS, held_bytes, buffered_bytes, spilled_bytes, open groups (MiB)."""
    started = time.monotonic()
    with open(path, "w") as f:
        f.write("s,rss_mib,held_mib,buffered_mib,spilled_mib,open_groups,inflight_groups\n")
        while not stop.wait(0.25):
            try:
                rss = _rss_bytes(stage.proc.pid)
            except OSError:
                return
            _, text = stage.get("/metrics")
            mb = 1 << 20
            f.write(f"{time.monotonic() - started:.2f},{rss / mb:.0f},{_gauge(text, 'held_bytes') / mb:.0f},"
                    f"{_gauge(text, 'buffered_bytes') / mb:.0f},{_gauge(text, 'spilled_bytes') / mb:.0f},"
                    f"{_gauge(text, 'open_groups'):.0f},{_gauge(text, 'inflight_groups'):.0f}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--cap-mib", type=int, default=512)
    parser.add_argument("--inline", action="store_true", help="routes inline in the staged calls")
    parser.add_argument("--consumer", action="append", default=[], metavar="KEY=VALUE",
                        help="a librdkafka consumer setting for the stage (repeatable)")
    parser.add_argument("--trace", metavar="CSV", help="write RSS and the gauges every 0.25 s here")
    parser.add_argument("--bootstrap-servers")
    args = parser.parse_args()
    cap = args.cap_mib << 20
    with bench_broker(args.bootstrap_servers, heap="1g") as (bootstrap, _kind):
        topics = _topics(f"memref-{uuid.uuid4().hex[:6]}")
        cfg = _config(bootstrap, topics, routes="direct").replace(max_buffered_bytes=cap, group_timeout_ms=600_000)
        cfg = cfg.replace(finalize=cfg.finalize.model_copy(update={"route_layers": 48, "route_topk": 8}),
                          consumer={**cfg.consumer, **dict(kv.split("=", 1) for kv in args.consumer)})
        create_topics(AdminClient({"bootstrap.servers": bootstrap}), cfg, partitions=2, replication=1,
                      min_insync_replicas=1, max_message_bytes=BENCH_MAX_RECORD_BYTES + (1 << 20))
        staged_codec = AvroCodec("StagedCall", max_record_bytes=BENCH_MAX_RECORD_BYTES)
        chunk_codec = AvroCodec("RouteChunk")
        stage = StageProcess(cfg)
        started = time.monotonic()
        try:
            stage.wait_ready()
            time.sleep(2.0)
            idle = _rss_bytes(stage.proc.pid)
            sampler = Sampler(stage)
            if args.trace:
                import threading
                stop_trace = threading.Event()
                threading.Thread(target=trace, args=(stage, args.trace, stop_trace), daemon=True).start()
            producer = Producer({"bootstrap.servers": bootstrap, "partitioner": LIBRDKAFKA_PARTITIONER,
                                 "message.max.bytes": BENCH_MAX_RECORD_BYTES + (1 << 20), "linger.ms": 5,
                                 "queue.buffering.max.kbytes": 1 << 20})
            input_bytes, receipts = 0, []
            for g in range(args.groups):
                group = fixed_group(n=16, calls=8, tokens=1024, layers=48, topk=8, dtype="int16", seed=g,
                                    group_id=f"mem{g}")
                key = group.group_id.encode()
                for role, raw in group.records:
                    if role == RECEIPTS:
                        receipts.append((key, raw))
                        continue
                    if not args.inline:
                        raw = staged_codec.encode(by_reference(producer, topics, group.group_id,
                                                               staged_codec.decode(raw), chunk_codec))
                    produce(producer, topics.staged_calls, key=key, value=raw)
                    producer.poll(0)
                input_bytes += group.nbytes
                producer.flush(120)
            for key, raw in receipts:
                produce(producer, topics.receipts, key=key, value=raw)
            producer.flush(120)
            published = _summaries(bootstrap, topics.finalized_groups, args.groups, 1500)
            sampler.stop()
            if args.trace:
                stop_trace.set()
        finally:
            stage.stop()
    mb = 1 << 20
    print(machine_line(machine_info()))
    print(f"direct router replay, routes {'inline' if args.inline else 'by reference'}"
          f"{', consumer ' + ' '.join(args.consumer) if args.consumer else ''}: {args.groups} groups "
          f"of 16 x 8 calls x 1,024 tokens, 48x8 int16 routes, all open; cap {args.cap_mib} MiB, input "
          f"{input_bytes / mb:,.0f} MiB; {published}/{args.groups} published in {time.monotonic() - started:.0f} s")
    print(f"  idle RSS {idle / mb:,.0f} MiB, peak RSS {sampler.peak_rss / mb:,.0f} MiB: peak - idle = "
          f"{(sampler.peak_rss - idle) / mb:,.0f} MiB = {(sampler.peak_rss - idle) / cap:.2f}x the cap "
          f"(target <= 1.5x); peak held_bytes {sampler.peak_held / mb:,.0f} MiB, peak buffered_bytes "
          f"{sampler.peak_buffered / mb:,.0f} MiB")
    return 0 if published == args.groups else 1


if __name__ == "__main__":
    raise SystemExit(main())
