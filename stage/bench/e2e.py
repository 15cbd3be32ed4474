"""``rollout-reassembler bench e2e``: the stage against a plain consume-and-produce passthrough of
the same input bytes on the same broker, in one run, then latency at half of the stage's peak.

1. passthrough: a transactional consume -> produce loop copying every input record (receipts and
   staged calls) to an output topic, committing offsets in each transaction (like the stage);
2. stage: StageRuntime over an identical, pre-filled topic set (peak throughput);
3. latency: the stage running while groups arrive at half that peak rate; for each group the
   time from its last input record being acknowledged to its last row being readable by a
   read_committed consumer.
Throughput counts input records (and bytes) from partition assignment to the last commit.

``--profile agentic-moe`` (or ``frontier``) feeds groups of that workload profile (N=16, ~64
calls, 32k mean tokens; ``--layers 0`` stages them without routes) instead of the default's small groups, and
reports canonical tokens per second next to records per second.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
import uuid

import numpy as np
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.bench.broker import produce
from stage.bench.machine import machine_info, machine_line
from stage.client import receipt_event, staged_call_from_record
from stage.contract import encode_routed_experts
from stage.contract.producer import RolloutBuilder
from stage.config.model import StageConfig
from stage.runtime.loop import StageRuntime
from stage.runtime.kafka.topics import create_topics
from stage.wire import DEFAULT_MAX_RECORD_BYTES, AvroCodec, TopicNames
from stage.wire.partitioner import LIBRDKAFKA_PARTITIONER

logger = logging.getLogger(__name__)


def build_inputs(groups: int, n: int, calls: int, tokens: int, layers: int, topk: int, seed: int = 0):
    """Pre-encoded input records: list per group of (topic role, key, value bytes)."""
    rng = np.random.default_rng(seed)
    receipt_codec, staged_codec = AvroCodec("ReceiptEvent"), AvroCodec("StagedCall")
    out = []
    for g in range(groups):
        group_id = f"bench-{seed}-{g}"
        staged, receipts = [], []
        for i in range(n):
            builder = RolloutBuilder(f"{group_id}-r{i}")
            parent = None
            for c in range(calls):
                carry, gen = tokens // 2, tokens - tokens // 2
                extras = {"routed_experts": encode_routed_experts(
                    rng.integers(0, 127, (tokens, layers, topk)), "int8")} if layers else None
                call = builder.stage(f"c{c}", parent_call_id=parent,
                                     prompt_delta=rng.integers(0, 150_000, carry),
                                     generated=rng.integers(0, 150_000, gen),
                                     generated_logprobs=-rng.random(gen), weight_version=1, extras=extras)
                staged.append(staged_codec.encode(staged_call_from_record(group_id, call.record)))
                parent = f"c{c}"
            receipts.append(receipt_codec.encode(receipt_event(
                group_id=group_id, rollout_id=builder.rollout_id, rollout_index=i, group_size=n,
                prompt_idx=g, reward=1.0, receipt=builder.receipt(parent))))
        out.append((group_id, [("staged_calls", v) for v in staged] + [("receipts", v) for v in receipts]))
    return out


def _topics(tag: str) -> TopicNames:
    return TopicNames(**{k: f"bench-{tag}.{v}" for k, v in TopicNames().all().items()})


POOL: dict = {}   # finalize_pool / finalize_workers of the stage runs (bench e2e --workers)


def _config(bootstrap: str, topics: TopicNames, routes: str = "off",
            max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> StageConfig:
    from stage.finalize import ReassemblyConfig
    finalize = ReassemblyConfig(router_replay=routes != "off", defer_routes=routes == "deferred",
                                staging_partition=topics.staged_calls)
    return StageConfig(bootstrap_servers=bootstrap, topics=topics, group_id=f"g-{topics.receipts}",
                       transactional_id=f"tx-{topics.receipts}", group_timeout_ms=60_000,
                       publish_linger_ms=20, poll_timeout_ms=10, metrics_port=0, finalize=finalize,
                       max_record_bytes=max_record_bytes, consumer={"session.timeout.ms": 6000}, **POOL)


def profile_inputs(profile: str, groups: int, layers: int | None, *, first: int = 0):
    """(group_id, [(role, value)]) of ``groups`` groups of a workload profile, and their tokens."""
    from stage.bench.inputs import bench_profile, profile_groups
    overrides = {} if layers is None else {"route_layers": layers}
    cfg = bench_profile(profile, **overrides)
    out, tokens = [], 0
    for g in profile_groups(cfg, groups, first=first):
        out.append((g.group_id, g.records))
        tokens += g.chain_tokens
    return cfg, out, tokens


def _fill(producer: Producer, topics: TopicNames, inputs) -> int:
    nbytes = 0
    for group_id, records in inputs:
        for role, value in records:
            produce(producer, getattr(topics, role), key=group_id.encode(), value=value)
            nbytes += len(value)
            producer.poll(0)
    producer.flush(120)
    return nbytes


def run_passthrough(bootstrap: str, topics: TopicNames, total: int, batch: int = 500,
                    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> float:
    """Copy every input record to the rows topic in transactions: the broker's cost of the
    stage's reads and writes, with client limits as the stage sizes them for its record cap."""
    from stage.client.consuming import fetch_limits
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"pt-{uuid.uuid4().hex[:6]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "isolation.level": "read_committed", **fetch_limits(max_record_bytes)})
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"pt-{uuid.uuid4().hex[:6]}",
                         "linger.ms": 5, "message.max.bytes": max_record_bytes + (1 << 20)})
    producer.init_transactions(60)
    assigned = threading.Event()
    consumer.subscribe([topics.receipts, topics.staged_calls], on_assign=lambda c, p: assigned.set())
    started, seen = None, 0
    deadline = time.monotonic() + 600
    while seen < total and time.monotonic() < deadline:
        messages = consumer.consume(batch, 0.05)
        messages = [m for m in messages if not m.error()]
        if not messages:
            continue
        if started is None:
            started = time.monotonic()
        producer.begin_transaction()
        offsets: dict = {}
        for m in messages:
            producer.produce(topics.canonical_rows, key=m.key(), value=m.value(), partition=m.partition())
            offsets[(m.topic(), m.partition())] = m.offset() + 1
        producer.send_offsets_to_transaction([TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                             consumer.consumer_group_metadata(), 60)
        producer.commit_transaction(60)
        seen += len(messages)
    elapsed = time.monotonic() - (started or time.monotonic())
    consumer.close()
    return elapsed


def run_stage(cfg: StageConfig, groups: int) -> float:
    runtime = StageRuntime(cfg)
    runtime.start()
    started = None
    deadline = time.monotonic() + 600
    try:
        while runtime.stats.total("groups_published") < groups and time.monotonic() < deadline:
            runtime.step()
            if started is None and runtime.stats.total("records_consumed") > 0:
                started = time.monotonic()
    finally:
        elapsed = time.monotonic() - (started or time.monotonic())
        runtime.shutdown()
    return elapsed


class StageProcess:
    """``rollout-reassembler run`` in its own process: the latency measurement must not share a
    GIL with the feeder and the reader that do the measuring."""

    def __init__(self, cfg: StageConfig) -> None:
        import os
        import subprocess
        import sys
        import tempfile

        import yaml

        from stage.brokers.kraft import free_port
        self.port = free_port()
        cfg = cfg.replace(metrics_port=self.port)
        values = cfg.model_dump()
        self.dir = tempfile.mkdtemp(prefix="bench-stage-")
        config = os.path.join(self.dir, "stage.yaml")
        with open(config, "w") as f:
            yaml.safe_dump(values, f)
        self.log = open(os.path.join(self.dir, "stage.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "stage", "run", "--config", config,
                                      "--log-level", "WARNING"], stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str) -> tuple[int, str]:
        import urllib.error
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""
        except OSError:
            return 0, ""

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.get("/readyz")[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the stage process did not become ready; log in {self.dir}")
            time.sleep(0.1)

    def quantiles(self, names) -> dict:
        """p50/p99 (ms) of the stage's own histograms, from /metrics buckets."""
        _, text = self.get("/metrics")
        out = {}
        for name in names:
            buckets = []
            for line in text.splitlines():
                prefix = f"rollout_reassembler_{name}_bucket{{le=\""
                if line.startswith(prefix):
                    le, value = line[len(prefix):].split("\"} ")
                    buckets.append((float(le), float(value)))
            if buckets and buckets[-1][1] > 0:
                total = buckets[-1][1]
                pick = lambda q: next(le for le, count in buckets if count >= q * total)  # noqa: E731
                out[name] = {"p50_le": pick(0.5) * 1e3, "p99_le": pick(0.99) * 1e3}
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except Exception:  # noqa: BLE001
            self.proc.kill()
        self.log.close()


def measure_latency(bootstrap: str, cfg: StageConfig, inputs, rate_groups_s: float, group_size: int = 4):
    """Feed groups at ``rate_groups_s`` into a stage running in its own process; per group,
    input-acked -> rows-readable. Also the stage's own histogram quantiles (bucket bounds)."""
    stage = StageProcess(cfg)
    stop = threading.Event()
    acked: dict[str, float] = {}
    readable: dict[str, float] = {}
    rows_seen: dict[str, int] = {}
    # A short fetch wait: rows count as readable when committed, not when a lazy reader's
    # long-poll happens to return (read_committed fetches can park for fetch.wait.max.ms).
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"lat-{uuid.uuid4().hex[:6]}",
                       "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                       "enable.auto.commit": False, "fetch.wait.max.ms": 10})
    reader.subscribe([cfg.topics.canonical_rows])

    def read_rows():
        while not stop.is_set():
            for m in reader.consume(500, 0.02):
                if m.error():
                    continue
                gid = m.key().decode()
                rows_seen[gid] = rows_seen.get(gid, 0) + 1
                if rows_seen[gid] == group_size:
                    readable[gid] = time.monotonic()

    reader_thread = threading.Thread(target=read_rows, daemon=True)

    def serve_acks():
        # delivery callbacks stamp the ack time when served: serve them as they come, not only
        # between groups (a 1,000-record group would stamp its last ack after its rows are read)
        while not stop.is_set():
            producer.poll(0.005)

    acks_thread = threading.Thread(target=serve_acks, daemon=True)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0,
                         "message.max.bytes": cfg.max_record_bytes + (1 << 20),
                         "partitioner": LIBRDKAFKA_PARTITIONER})
    try:
        stage.wait_ready()
        reader_thread.start()
        acks_thread.start()
        time.sleep(1.0)
        interval = 1.0 / rate_groups_s
        next_at = time.monotonic()
        for group_id, records in inputs:
            while time.monotonic() < next_at:
                time.sleep(max(0.0, min(0.001, next_at - time.monotonic())))
            next_at += interval
            last = len(records) - 1
            for i, (role, value) in enumerate(records):
                callback = None
                if i == last:
                    callback = (lambda gid: lambda err, msg: acked.__setitem__(gid, time.monotonic()))(group_id)
                produce(producer, getattr(cfg.topics, role), key=group_id.encode(), value=value,
                        on_delivery=callback)
            producer.poll(0)
        producer.flush(60)
        deadline = time.monotonic() + 120
        while len(readable) < len(inputs) and time.monotonic() < deadline:
            producer.poll(0.05)
        inside = stage.quantiles(("finalize_seconds", "publish_seconds", "group_fill_seconds"))
    finally:
        stop.set()
        stage.stop()
        if reader_thread.is_alive():
            reader_thread.join(10)
        reader.close()
    return [readable[g] - acked[g] for g in readable if g in acked], inside


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(*, bootstrap: str | None = None, groups: int | None = None, n: int = 4, calls: int = 3,
        tokens: int = 128, layers: int | None = None, topk: int = 2, partitions: int = 2,
        latency_seconds: float = 10.0, as_json: bool = False, profile: str = "default",
        routes: str = "off", pool: str = "thread", workers: int = 1) -> dict:
    POOL.update(finalize_pool=pool, finalize_workers=workers)
    from stage.bench.broker import bench_broker
    with bench_broker(bootstrap) as (servers, kind):
        return _run(servers, groups, n, calls, tokens, layers, topk, partitions, latency_seconds,
                    as_json, broker_kind=kind, profile=profile, routes=routes)


def _run(bootstrap, groups, n, calls, tokens, layers, topk, partitions, latency_seconds, as_json,
         broker_kind, profile="default", routes="off") -> dict:
    from stage.bench.inputs import BENCH_MAX_RECORD_BYTES
    from stage.bench.pipeline import load_average
    load_before = load_average()
    admin = AdminClient({"bootstrap.servers": bootstrap})
    tag = uuid.uuid4().hex[:6]
    sets = {name: _topics(f"{tag}-{name}") for name in ("passthrough", "stage", "latency")}
    record_cap = DEFAULT_MAX_RECORD_BYTES if profile == "default" else BENCH_MAX_RECORD_BYTES
    for topics in sets.values():
        cfg = _config(bootstrap, topics, routes, record_cap)
        # one local broker: one replica; returns once every partition has a leader
        create_topics(admin, cfg, partitions=partitions, replication=1, min_insync_replicas=1,
                      max_message_bytes=record_cap + (1 << 20))
    if profile == "default":
        groups = groups or 300
        layers = 8 if layers is None else layers
        inputs = build_inputs(groups, n, calls, tokens, layers, topk)
        canonical_tokens = groups * n * calls * tokens
        line = (f"profile default: {groups} groups x {n} rollouts x {calls} calls x {tokens} tokens, "
                f"routes {layers}x{topk}")
    else:
        from stage.bench.inputs import profile_line
        groups = groups or 3
        wl, inputs, canonical_tokens = profile_inputs(profile, groups, layers)
        n = wl.group_size
        line = f"{groups} groups of " + profile_line(profile, wl)
    records = sum(len(r) for _, r in inputs)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                         "message.max.bytes": record_cap + (1 << 20), "partitioner": LIBRDKAFKA_PARTITIONER})
    nbytes = _fill(producer, sets["passthrough"], inputs)
    _fill(producer, sets["stage"], inputs)
    passthrough_s = run_passthrough(bootstrap, sets["passthrough"], records, max_record_bytes=record_cap)
    stage_s = run_stage(_config(bootstrap, sets["stage"], routes, record_cap), groups)
    stage_groups_s = groups / stage_s
    rate = stage_groups_s / 2
    if profile == "default":
        latency_inputs = build_inputs(max(20, int(rate * latency_seconds)), n, calls, tokens, layers, topk, seed=1)
    else:
        _wl, latency_inputs, _tokens = profile_inputs(profile, max(2, int(rate * latency_seconds)), layers,
                                                      first=groups)
    del inputs
    latencies, inside = measure_latency(bootstrap, _config(bootstrap, sets["latency"], routes, record_cap),
                                        latency_inputs, rate, group_size=n)
    report = {
        "benchmark": "e2e", "broker": broker_kind, "partitions": partitions, "profile": profile,
        "profile_line": line, "routes": routes, "load_before": load_before,
        "workload": {"groups": groups, "rollouts_per_group": n, "input_records": records, "input_bytes": nbytes,
                     "canonical_tokens": canonical_tokens},
        "passthrough": {"seconds": passthrough_s, "records_per_s": records / passthrough_s,
                        "mb_per_s": nbytes / passthrough_s / 1e6},
        "stage": {"seconds": stage_s, "records_per_s": records / stage_s, "mb_per_s": nbytes / stage_s / 1e6,
                  "groups_per_s": stage_groups_s, "canonical_tokens_per_s": canonical_tokens / stage_s},
        "throughput_ratio": passthrough_s / stage_s,
        "latency": {"offered_groups_per_s": rate, "groups": len(latencies),
                    "p50_ms": _percentile(latencies, 0.5) * 1e3 if latencies else None,
                    "p99_ms": _percentile(latencies, 0.99) * 1e3 if latencies else None,
                    "mean_ms": statistics.mean(latencies) * 1e3 if latencies else None,
                    # where a group's time goes inside the stage during the latency run
                    # (upper bounds of the Prometheus buckets holding the quantile)
                    "inside_stage_ms": inside},
        "load_after": load_average(), "machine": machine_info(),
    }
    report["meets_targets"] = bool(report["throughput_ratio"] >= 0.8 and latencies
                                   and report["latency"]["p99_ms"] <= 250)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        w, p, s, lat = report["workload"], report["passthrough"], report["stage"], report["latency"]
        print(f"e2e on {broker_kind}, {partitions} partitions, router replay {routes}, finalize "
              f"{POOL.get('finalize_workers', 1)} {POOL.get('finalize_pool', 'thread')}(s): {line}; "
              f"{w['input_records']} input records, {w['input_bytes'] / 1e6:.1f} MB; machine load {load_before}")
        print(machine_line(report["machine"]))
        print(f"passthrough: {p['records_per_s']:,.0f} records/s ({p['mb_per_s']:.1f} MB/s)")
        print(f"stage:       {s['records_per_s']:,.0f} records/s ({s['mb_per_s']:.1f} MB/s, "
              f"{s['groups_per_s']:.2f} groups/s, {s['canonical_tokens_per_s'] / 1e6:.2f} M canonical tokens/s)"
              f"  ratio {report['throughput_ratio']:.2f} (target >= 0.80)")
        if latencies:
            print(f"latency at {lat['offered_groups_per_s']:.2f} groups/s (half of peak), {lat['groups']} groups: "
                  f"p50 {lat['p50_ms']:.0f} ms, p99 {lat['p99_ms']:.0f} ms (target p99 <= 250 ms)")
            print("  inside the stage (bucket bounds): " + ", ".join(
                f"{name.replace('_seconds', '')} p50 <= {v['p50_le']:.0f} / p99 <= {v['p99_le']:.0f} ms"
                for name, v in lat["inside_stage_ms"].items()))
        print(f"machine load after: {report['load_after']}")
    return report
