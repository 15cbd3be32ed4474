"""``rollout-reassembler bench e2e``: the stage against a plain consume-and-produce passthrough of
the same input bytes on the same broker, in one run, then latency at half of the stage's peak.

1. passthrough: a transactional consume -> produce loop copying every input record (receipts and
   staged calls) to an output topic, committing offsets in each transaction (like the stage);
2. stage: StageRuntime over an identical, pre-filled topic set (peak throughput); with an anchor
   (below), the stage and the anchor again, in the order anchor, stage, stage, anchor, that block
   ``repeats`` times (default 2), compared by the median of each one's runs;
3. latency: the stage running while groups arrive at half that peak rate; for each group the
   time from its last input record being acknowledged to its last row being readable by a
   read_committed consumer. Routes by reference that the stage does not read (router replay
   deferred or off): a second feed of the same groups whose route
   chunks were written before it (a rollout's calls stage their routes while it runs, long
   before its receipt), so that the feed is what a rollout owner sends last: its p99 is the one
   judged; the first feed, chunks and all, is printed beside it. ``--profile-stage FILE``: py-spy samples that stage process
   (stage.bench.stage_profile) and the report gives its CPU per input record by function.
Throughput counts input records (and bytes) from partition assignment to the last commit.

``--profile agentic-moe`` (or ``frontier``) feeds groups of that workload profile (N=16, ~64
calls, 32k mean tokens; ``--layers 0`` stages them without routes) instead of the default's small groups, and
reports canonical tokens per second next to records per second.

Inputs are written by the SDK's producer (stage.client.StagingProducer). Routes go by reference
(``route_staging="by-reference"``, the default): each call's RouteChunk records to the route
topic first, the StagedCall naming their offsets once the broker acknowledged them (claim-check),
every record within ``stage.wire.DEFAULT_MAX_RECORD_BYTES``; ``"inline"``: inside the staged calls
(producers before issue 26; the profiles then need a larger record cap). Issue 26's targets are
printed as ratios against anchors of the same run:
- the bytes the stage's consumer fetched (librdkafka statistics: its partitions' ``rxbytes``)
  over the bytes the producers wrote (chunks, staged calls, receipts): deferred, <= 5%;
- deferred: the stage's canonical tokens/s over its tokens/s on the same groups generated
  without routes (a fourth topic set, the "anchor"; the generator draws routes from a stream of
  their own, so the same seed gives the same rollouts, tokens and calls without them): >= 0.9;
- direct, by reference: the anchor is the same groups with routes inline; per group, inline
  seconds over by-reference seconds: >= 1 (no slower);
- latency (phase 3) p99 <= 1 s for a profile's groups (250 ms for the default case).
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

from stage.bench.machine import machine_info, machine_line
from stage.client import receipt_event, staged_call_from_record
from stage.contract import encode_routed_experts
from stage.contract.producer import RolloutBuilder
from stage.config.model import StageConfig
from stage.runtime.loop import StageRuntime
from stage.runtime.kafka.topics import create_topics
from stage.wire import DEFAULT_MAX_RECORD_BYTES, AvroCodec, TopicNames

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
PROFILE_STAGE: dict = {}   # "path": py-spy's collapsed stacks of the latency phase's stage process


def _config(bootstrap: str, topics: TopicNames, routes: str = "off",
            max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> StageConfig:
    from stage.finalize import ReassemblyConfig
    finalize = ReassemblyConfig(router_replay=routes != "off", defer_routes=routes == "deferred",
                                staging_partition=topics.staged_calls)
    return StageConfig(bootstrap_servers=bootstrap, topics=topics, group_id=f"g-{topics.receipts}",
                       transactional_id=f"tx-{topics.receipts}", group_timeout_ms=60_000,
                       publish_linger_ms=20, poll_timeout_ms=10, metrics_port=0, finalize=finalize,
                       max_record_bytes=max_record_bytes, consumer={"session.timeout.ms": 6000}, **POOL)


def profile_inputs(profile: str, groups: int, layers: int | None, *, first: int = 0, **overrides):
    """(group_id, [(role, value)]) of ``groups`` groups of a workload profile (``overrides``:
    WorkloadConfig fields), and their tokens."""
    from stage.bench.inputs import bench_profile, profile_groups
    if layers is not None:
        overrides = {**overrides, "route_layers": layers}
    cfg = bench_profile(profile, **overrides)
    out, tokens = [], 0
    for g in profile_groups(cfg, groups, first=first):
        out.append((g.group_id, g.records))
        tokens += g.chain_tokens
    return cfg, out, tokens


def by_reference(inputs: list):
    """The same groups for a producer staging routes by reference: each staged call carrying
    routes as its decoded value (``StagingProducer.send_staged`` writes its chunks first, then
    the call naming them), every other record as encoded. ``inputs`` is emptied group by group
    as they are converted: a frontier group is ~1 GB of routes, and holding every group twice
    (encoded and decoded) took a latency phase's ten of them past the machine's memory."""
    from stage.bench.inputs import BENCH_MAX_RECORD_BYTES
    codec = AvroCodec("StagedCall", max_record_bytes=BENCH_MAX_RECORD_BYTES)
    out = []
    inputs.reverse()
    while inputs:
        group_id, records = inputs.pop()
        converted = []
        for role, value in records:
            if role == "staged_calls":
                decoded = codec.decode(value)
                if decoded.get("routed_experts") is not None:
                    value = decoded
            converted.append((role, value))
        out.append((group_id, converted))
    return out


class Writer:
    """The SDK's producer (stage.client.StagingProducer) on one topic set: a staged call given
    as a value with routes goes by reference (its RouteChunk records, then, once the broker has
    acknowledged them, the call naming their offsets); encoded records go as they are. Counts
    what was written, per topic, and stamps when each group's last record was acknowledged."""

    def __init__(self, bootstrap: str, topics: TopicNames, max_record_bytes: int, **config) -> None:
        from stage.client import StagingProducer
        self.topics = topics
        self.records: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}
        self.pending: dict[str, int] = {}      # group -> records not acknowledged yet
        self.acked: dict[str, float] = {}      # group -> when its last record was acknowledged
        self._lock = threading.Lock()
        self.sdk = StagingProducer(bootstrap, topics=topics, max_record_bytes=max_record_bytes,
                                   on_delivery=self._delivered,
                                   config={"linger.ms": 20, "queue.buffering.max.kbytes": 1 << 20, **config})

    def _delivered(self, delivery) -> None:
        with self._lock:
            self.records[delivery.topic] = self.records.get(delivery.topic, 0) + 1
            if delivery.topic == self.topics.staged_routes:
                return
            gid = delivery.key.decode()
            self.pending[gid] -= 1
            if not self.pending[gid]:
                self.acked[gid] = time.monotonic()

    def _count(self, topic: str, nbytes: int) -> None:
        with self._lock:
            self.nbytes[topic] = self.nbytes.get(topic, 0) + nbytes

    def group(self, group_id: str, records) -> None:
        with self._lock:
            self.pending[group_id] = len(records)
        for role, value in records:
            topic = getattr(self.topics, role)
            if isinstance(value, dict):
                self._count(self.topics.staged_routes, self.sdk.send_staged(group_id, value))
            else:
                self._count(topic, self.sdk.produce(topic, group_id, value))

    def flush(self) -> None:
        self.sdk.flush(600)
        # staged calls by reference were produced from delivery callbacks: their bytes are the rest
        with self._lock:
            counted = sum(self.nbytes.values())
            self.nbytes[self.topics.staged_calls] = (self.nbytes.get(self.topics.staged_calls, 0)
                                                     + self.sdk.produced_bytes - counted)

    @property
    def written_bytes(self) -> int:
        return sum(self.nbytes.values())


def _fill(writer: Writer, inputs) -> int:
    for group_id, records in inputs:
        writer.group(group_id, records)
    writer.flush()
    return writer.written_bytes


def run_passthrough(bootstrap: str, topics: TopicNames, total: int, batch: int = 500,
                    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, routes: bool = False) -> float:
    """Copy every input record the stage reads (receipts, staged calls; ``routes``: the route
    topic's chunks too, as direct router replay reads them) to the rows topic in transactions:
    the broker's cost of the stage's reads and writes, with client limits as the stage sizes
    them for its record cap."""
    from stage.client.consuming import fetch_limits
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"pt-{uuid.uuid4().hex[:6]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "isolation.level": "read_committed", **fetch_limits(max_record_bytes)})
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"pt-{uuid.uuid4().hex[:6]}",
                         "linger.ms": 5, "message.max.bytes": max_record_bytes + (1 << 20)})
    producer.init_transactions(60)
    assigned = threading.Event()
    consumer.subscribe([topics.receipts, topics.staged_calls] + ([topics.staged_routes] if routes else []),
                       on_assign=lambda c, p: assigned.set())
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


def run_stage(cfg: StageConfig, groups: int) -> tuple[float, dict[str, int]]:
    """The stage in this process until ``groups`` groups are published: (seconds from its first
    record to the last group published, the bytes its consumer fetched per topic, from
    librdkafka's statistics: the partitions' ``rxbytes``)."""
    cfg = cfg.replace(statistics_interval_ms=STATS_INTERVAL_MS)
    runtime = StageRuntime(cfg)
    latest: list[str] = []      # the statistics documents since the last clear (two at most)
    sink_stats = runtime.stats.sink.librdkafka_stats

    def stats(text: str) -> None:
        latest[:] = latest[-1:] + [text]
        sink_stats(text)

    runtime.stats.sink.librdkafka_stats = stats   # read when the consumer is made (start)
    runtime.start()
    started = None
    deadline = time.monotonic() + 600
    try:
        while runtime.stats.total("groups_published") < groups and time.monotonic() < deadline:
            runtime.step()
            if started is None and runtime.stats.total("records_consumed") > 0:
                started = time.monotonic()
        elapsed = time.monotonic() - (started or time.monotonic())
        # statistics after the last fetch: the loop runs (untimed) until two more documents came
        latest.clear()
        until = time.monotonic() + 5
        while len(latest) < 2 and time.monotonic() < until:
            runtime.step()
    finally:
        runtime.shutdown()
    return elapsed, fetched_bytes(latest[-1] if latest else "{}")


STATS_INTERVAL_MS = 200


def fetched_bytes(stats_json: str) -> dict[str, int]:
    """Bytes a consumer fetched per topic: the sum of its partitions' ``rxbytes`` in one
    librdkafka statistics document (the -1 partition, librdkafka's internal one, left out)."""
    out: dict[str, int] = {}
    for topic, info in json.loads(stats_json).get("topics", {}).items():
        out[topic] = sum(int(p.get("rxbytes", 0)) for key, p in info.get("partitions", {}).items()
                         if key != "-1")
    return out


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


def chunks_written_ahead(bootstrap: str, cfg: StageConfig, inputs, admin: AdminClient, partitions: int):
    """``inputs`` with every route chunk already on ``cfg``'s route topic: each group's staged
    calls by reference are written through the SDK (chunks first, then the call naming their
    offsets) to a holding topic co-partitioned with the staged calls', read back, and returned
    as encoded records in their group's order, receipts after them, for a feed that produces
    only what a rollout owner sends last (the staged calls and receipts) while the chunks, as
    in a real rollout, went to the broker while its calls were made."""
    held = cfg.topics.model_copy(update={"staged_calls": cfg.topics.staged_calls + ".held"})
    create_topics(admin, cfg.replace(topics=held), partitions=partitions, replication=1,
                  min_insync_replicas=1, max_message_bytes=cfg.max_record_bytes + (1 << 20))
    writer = Writer(bootstrap, held, cfg.max_record_bytes)
    _fill(writer, [(g, [(role, v) for role, v in records if role == "staged_calls"]) for g, records in inputs])
    expected = sum(1 for _, records in inputs for role, _ in records if role == "staged_calls")
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"held-{uuid.uuid4().hex[:6]}",
                       "auto.offset.reset": "earliest", "enable.auto.commit": False})
    reader.subscribe([held.staged_calls])
    calls: dict[str, list[tuple[str, bytes]]] = {}
    got, deadline = 0, time.monotonic() + 120
    try:
        while got < expected and time.monotonic() < deadline:
            for m in reader.consume(500, 0.5):
                if not m.error():
                    calls.setdefault(m.key().decode(), []).append(("staged_calls", m.value()))
                    got += 1
    finally:
        reader.close()
    if got < expected:
        raise RuntimeError(f"read back {got} of {expected} staged calls from {held.staged_calls}")
    return [(g, calls.get(g, []) + [(role, v) for role, v in records if role != "staged_calls"])
            for g, records in inputs]


def measure_latency(bootstrap: str, cfg: StageConfig, inputs, rate_groups_s: float, group_size: int = 4):
    """Feed groups at ``rate_groups_s`` into a stage running in its own process; per group, from
    its last input record acknowledged (the last of its staged calls and receipts; by reference,
    a staged call is produced once its chunks are acknowledged, so it comes after them) to its
    rows readable. Also the stage's own histogram quantiles (bucket bounds)."""
    stage = StageProcess(cfg)
    stop = threading.Event()
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
    writer = Writer(bootstrap, cfg.topics, cfg.max_record_bytes, **{"linger.ms": 0})

    def serve_acks():
        # delivery callbacks stamp the ack time when served (and queue the staged calls whose
        # chunks are in): serve them as they come, not only between groups
        while not stop.is_set():
            writer.sdk.poll(0.005)

    acks_thread = threading.Thread(target=serve_acks, daemon=True)
    sampler = None
    try:
        stage.wait_ready()
        if PROFILE_STAGE.get("path"):   # after start-up: the stage's CPU per record, not its imports
            from stage.bench.stage_profile import Sampler
            sampler = Sampler(stage.proc.pid, PROFILE_STAGE["path"])
        reader_thread.start()
        acks_thread.start()
        time.sleep(1.0)
        interval = 1.0 / rate_groups_s
        next_at = time.monotonic()
        for group_id, records in inputs:
            while time.monotonic() < next_at:
                time.sleep(max(0.0, min(0.001, next_at - time.monotonic())))
            next_at += interval
            writer.group(group_id, records)
        writer.sdk.flush(120)
        deadline = time.monotonic() + 120
        while len(readable) < len(inputs) and time.monotonic() < deadline:
            time.sleep(0.05)
        inside = stage.quantiles(("finalize_seconds", "publish_seconds", "group_fill_seconds"))
    finally:
        stop.set()
        if sampler is not None:
            sampler.stop()
        stage.stop()
        if reader_thread.is_alive():
            reader_thread.join(10)
        acks_thread.join(5)
        reader.close()
    acked = writer.acked
    return [readable[g] - acked[g] for g in readable if g in acked], inside


def _latency_report(latencies: list[float], rate: float, p99_target: float, inside: dict) -> dict:
    return {"offered_groups_per_s": rate, "groups": len(latencies),
            "p50_ms": _percentile(latencies, 0.5) * 1e3 if latencies else None,
            "p99_ms": _percentile(latencies, 0.99) * 1e3 if latencies else None,
            "mean_ms": statistics.mean(latencies) * 1e3 if latencies else None,
            "target_p99_ms": p99_target,
            # where a group's time goes inside the stage during the latency run
            # (upper bounds of the Prometheus buckets holding the quantile)
            "inside_stage_ms": inside}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(*, bootstrap: str | None = None, groups: int | None = None, n: int = 4, calls: int = 3,
        tokens: int = 128, layers: int | None = None, topk: int = 2, partitions: int = 2,
        latency_seconds: float = 10.0, as_json: bool = False, profile: str = "default",
        routes: str = "off", pool: str = "thread", workers: int = 1, route_staging: str = "by-reference",
        group_size: int | None = None, anchor: bool = True, profile_stage: str | None = None,
        repeats: int = 2) -> dict:
    POOL.update(finalize_pool=pool, finalize_workers=workers)
    PROFILE_STAGE["path"] = profile_stage
    if profile_stage:
        from stage.bench.stage_profile import py_spy
        py_spy()   # fail before the broker starts, not after the throughput runs
    from stage.bench.broker import bench_broker
    with bench_broker(bootstrap) as (servers, kind):
        return _run(servers, groups, n, calls, tokens, layers, topk, partitions, latency_seconds,
                    as_json, broker_kind=kind, profile=profile, routes=routes, route_staging=route_staging,
                    group_size=group_size, anchor=anchor, repeats=repeats)


ROUTE_STAGINGS = ("by-reference", "inline")
# issue 26's targets for routes by reference, printed as ratios against anchors of the same run
TARGET_CONSUMED_SHARE = 0.05     # deferred: bytes the stage fetched / bytes the producers wrote
TARGET_NO_ROUTES_RATIO = 0.9     # deferred: throughput / the same groups' without routes
TARGET_P99_MS = 1000.0           # a profile's groups at half load (the default case: 250 ms)


def _rerun(admin, bootstrap: str, topics: TopicNames, routes: str, cap: int, run: int,
           partitions: int) -> StageConfig:
    """A stage config reading ``topics``' inputs again from their first record: a new consumer
    group, transactional id and output topics (a ledger of its own: the earlier run's says its
    groups are published)."""
    outputs = ("canonical_rows", "route_plans", "finalized_groups", "dead_letter", "stage_ledger")
    topics = topics.model_copy(update={role: f"{getattr(topics, role)}.{run}" for role in outputs})
    cfg = _config(bootstrap, topics, routes, cap).replace(group_id=f"g-{topics.canonical_rows}",
                                                          transactional_id=f"tx-{topics.canonical_rows}")
    create_topics(admin, cfg, partitions=partitions, replication=1, min_insync_replicas=1,
                  max_message_bytes=cap + (1 << 20))
    return cfg


def chunks_ahead_feed(routes: str, route_staging: str, has_routes: bool) -> bool:
    """Whether the latency is also measured (and judged) with the route chunks written before
    the feed: routes staged by reference that the stage does not read (router replay deferred
    or off), whose chunks a rollout writes while it runs, not in the burst of its last records."""
    return routes != "direct" and route_staging == "by-reference" and has_routes


def anchor_kind(routes: str, route_staging: str, has_routes: bool) -> str | None:
    """The anchor stage run of the same groups: without routes for deferred router replay (the
    stage should cost what the token columns cost), routes inline for direct router replay by
    reference (no slower per group than before), none otherwise."""
    if not has_routes:
        return None
    if routes == "deferred":
        return "no-routes"
    if routes == "direct" and route_staging == "by-reference":
        return "inline"
    return None


def _run(bootstrap, groups, n, calls, tokens, layers, topk, partitions, latency_seconds, as_json,
         broker_kind, profile="default", routes="off", route_staging="by-reference", group_size=None,
         anchor=True, repeats=2) -> dict:
    from stage.bench.inputs import BENCH_MAX_RECORD_BYTES
    from stage.bench.pipeline import load_average
    load_before = load_average()
    admin = AdminClient({"bootstrap.servers": bootstrap})
    tag = uuid.uuid4().hex[:6]
    # Inline routes of the profiles need records over the default cap (the reason they go by
    # reference); by reference, every record fits stage.wire.DEFAULT_MAX_RECORD_BYTES.
    inline_cap = DEFAULT_MAX_RECORD_BYTES if profile == "default" else BENCH_MAX_RECORD_BYTES
    record_cap = DEFAULT_MAX_RECORD_BYTES if route_staging == "by-reference" else inline_cap
    overrides = {} if group_size is None else {"group_size": group_size}
    if profile == "default":
        groups = groups or 300
        layers = 8 if layers is None else layers
        inputs = build_inputs(groups, n, calls, tokens, layers, topk)
        canonical_tokens = groups * n * calls * tokens
        line = (f"profile default: {groups} groups x {n} rollouts x {calls} calls x {tokens} tokens, "
                f"routes {layers}x{topk}")
        has_routes = layers > 0
    else:
        from stage.bench.inputs import profile_line
        groups = groups or 3
        wl, inputs, canonical_tokens = profile_inputs(profile, groups, layers, **overrides)
        n = wl.group_size
        line = f"{groups} groups of " + profile_line(profile, wl)
        has_routes = bool(wl.routes)
    kind = anchor_kind(routes, route_staging, has_routes) if anchor else None
    ahead = chunks_ahead_feed(routes, route_staging, has_routes)
    names = ("passthrough", "stage", "latency") + (("anchor",) if kind else ()) + (("latency_ahead",) if ahead else ())
    sets = {name: _topics(f"{tag}-{name}") for name in names}
    caps = {name: inline_cap if name == "anchor" and kind == "inline" else record_cap for name in names}
    for name, topics in sets.items():
        # one local broker: one replica; returns once every partition has a leader
        create_topics(admin, _config(bootstrap, topics, routes, caps[name]), partitions=partitions,
                      replication=1, min_insync_replicas=1, max_message_bytes=caps[name] + (1 << 20))
    writers = {name: Writer(bootstrap, sets[name], caps[name]) for name in ("passthrough", "stage")}
    anchor_tokens = canonical_tokens
    if kind == "inline":     # the same records, routes inside the staged calls
        writers["anchor"] = Writer(bootstrap, sets["anchor"], caps["anchor"])
        _fill(writers["anchor"], inputs)
    if route_staging == "by-reference":
        inputs = by_reference(inputs)
    records = sum(len(r) for _, r in inputs)
    _fill(writers["passthrough"], inputs)
    _fill(writers["stage"], inputs)
    del inputs
    if kind == "no-routes":  # the same groups generated without routes
        writers["anchor"] = Writer(bootstrap, sets["anchor"], caps["anchor"])
        # the same groups less their routes (the generator's routes have a stream of their own)
        if profile == "default":
            plain, anchor_tokens = build_inputs(groups, n, calls, tokens, 0, topk), canonical_tokens
        else:
            _wl, plain, anchor_tokens = profile_inputs(profile, groups, 0, **overrides)
        _fill(writers["anchor"], plain)
        del plain
    written = writers["stage"]
    read_by_stage = [sets["stage"].receipts, sets["stage"].staged_calls] + (
        [sets["stage"].staged_routes] if routes == "direct" else [])
    pass_records = sum(writers["passthrough"].records.get(t.replace("stage", "passthrough", 1), 0)
                       for t in read_by_stage)
    stage_reads = sum(written.nbytes.get(t, 0) for t in read_by_stage)   # what its topics hold
    passthrough_s = run_passthrough(bootstrap, sets["passthrough"], pass_records, max_record_bytes=record_cap,
                                    routes=routes == "direct")
    stage_s, fetched = run_stage(_config(bootstrap, sets["stage"], routes, record_cap), groups)
    anchor_s, stage_runs, anchor_runs, run_order = None, [], [], []
    if kind:
        # after that first run (it pays the process's warm-up: imports, first allocations), the
        # stage and its anchor again in the order anchor, stage, stage, anchor, ``repeats``
        # times: neither gains from its place (warmer caches, the load of the other work on the
        # machine), and the medians leave out a run a neighbour's burst slowed
        for name in ("anchor", "stage", "stage", "anchor") * repeats:
            runs = anchor_runs if name == "anchor" else stage_runs
            seconds = run_stage(_rerun(admin, bootstrap, sets[name], routes, caps[name], len(runs), partitions),
                                groups)[0]
            runs.append(seconds)
            run_order.append((name, seconds))
        anchor_s = statistics.median(anchor_runs)
    compared_s = statistics.median(stage_runs) if stage_runs else stage_s
    stage_groups_s = groups / stage_s
    rate = stage_groups_s / 2
    if profile == "default":
        latency_inputs = build_inputs(max(20, int(rate * latency_seconds)), n, calls, tokens, layers, topk, seed=1)
    else:
        _wl, latency_inputs, _tokens = profile_inputs(profile, max(2, int(rate * latency_seconds)), layers,
                                                      first=groups, **overrides)
    if route_staging == "by-reference":
        latency_inputs = by_reference(latency_inputs)
    latencies, inside = measure_latency(bootstrap, _config(bootstrap, sets["latency"], routes, record_cap),
                                        latency_inputs, rate, group_size=n)
    p99_target = 250.0 if profile == "default" else TARGET_P99_MS
    latency_ahead = None
    if ahead:
        ahead_cfg = _config(bootstrap, sets["latency_ahead"], routes, record_cap)
        ahead_inputs = chunks_written_ahead(bootstrap, ahead_cfg, latency_inputs, admin, partitions)
        lat_ahead, inside_ahead = measure_latency(bootstrap, ahead_cfg, ahead_inputs, rate, group_size=n)
        latency_ahead = _latency_report(lat_ahead, rate, p99_target, inside_ahead)
    stage_profile = None
    if PROFILE_STAGE.get("path"):
        from stage.bench.stage_profile import summarize
        stage_profile = summarize(PROFILE_STAGE["path"], sum(len(r) for _, r in latency_inputs))
        stage_profile["groups"] = len(latency_inputs)
    fetched_total = sum(fetched.values())
    report = {
        "benchmark": "e2e", "broker": broker_kind, "partitions": partitions, "profile": profile,
        "profile_line": line, "routes": routes, "route_staging": route_staging, "record_cap": record_cap,
        "load_before": load_before,
        "workload": {"groups": groups, "rollouts_per_group": n, "input_records": records,
                     "input_bytes": stage_reads, "canonical_tokens": canonical_tokens},
        "written": {"records": dict(written.records), "bytes": dict(written.nbytes),
                    "total_bytes": written.written_bytes},
        "passthrough": {"seconds": passthrough_s, "records": pass_records,
                        "records_per_s": pass_records / passthrough_s},
        "stage": {"seconds": stage_s, "records_per_s": pass_records / stage_s, "mb_per_s": stage_reads / stage_s / 1e6,
                  "groups_per_s": stage_groups_s, "canonical_tokens_per_s": canonical_tokens / stage_s,
                  "fetched_bytes": fetched, "fetched_total_bytes": fetched_total},
        "throughput_ratio": passthrough_s / stage_s,
        "latency": _latency_report(latencies, rate, p99_target, inside),
        "load_after": load_average(), "machine": machine_info(),
    }
    if stage_profile is not None:
        report["stage_profile"] = stage_profile
    judged = report["latency"]
    if latency_ahead is not None:
        # the target is judged with the chunks written ahead (a rollout's calls stage their
        # routes while it runs, minutes before its receipt); the feed's figure is printed too
        report["latency_chunks_ahead"] = judged = latency_ahead
    targets = {"passthrough_ratio": (report["throughput_ratio"], ">=", 0.8),
               "latency_p99_ms": (judged["p99_ms"], "<=", p99_target)}
    if routes == "deferred" and has_routes:
        targets["consumed_share"] = (fetched_total / written.written_bytes, "<=", TARGET_CONSUMED_SHARE)
    if kind:
        report["stage"]["runs_seconds"] = stage_runs       # the runs compared with the anchor's
        report["stage"]["compared_seconds"] = compared_s
        report["run_order"] = run_order
        report["anchor"] = {"kind": kind, "seconds": anchor_s, "runs_seconds": anchor_runs, "canonical_tokens": anchor_tokens,
                            "canonical_tokens_per_s": anchor_tokens / anchor_s,
                            "seconds_per_group": anchor_s / groups}
        # no-routes: canonical tokens/s against the workload's without routes; inline: per group,
        # the inline stage's seconds over the by-reference stage's (>= 1: no slower)
        if kind == "no-routes":
            targets["no_routes_ratio"] = (canonical_tokens / compared_s / report["anchor"]["canonical_tokens_per_s"],
                                          ">=", TARGET_NO_ROUTES_RATIO)
        else:
            targets["inline_per_group_ratio"] = (anchor_s / compared_s, ">=", 1.0)
    report["targets"] = {name: {"value": value, "op": op, "target": target,
                                "met": value is not None and (value >= target if op == ">=" else value <= target)}
                         for name, (value, op, target) in targets.items()}
    report["meets_targets"] = bool(latencies) and all(t["met"] for t in report["targets"].values())
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, broker_kind, partitions, routes, route_staging, line, load_before, latencies)
    return report


def _print(report, broker_kind, partitions, routes, route_staging, line, load_before, latencies) -> None:
    w, p, s, lat, t = (report["workload"], report["passthrough"], report["stage"], report["latency"],
                       report["targets"])

    def mark(name: str) -> str:
        return "met" if t[name]["met"] else "MISSED"

    print(f"e2e on {broker_kind}, {partitions} partitions, router replay {routes}, routes staged {route_staging} "
          f"(record cap {report['record_cap']:,}), finalize {POOL.get('finalize_workers', 1)} "
          f"{POOL.get('finalize_pool', 'thread')}(s): {line}; {w['input_records']} input records, "
          f"{w['input_bytes'] / 1e6:.1f} MB on the topics the stage reads; machine load {load_before}")
    print(machine_line(report["machine"]))
    written = report["written"]
    print("written: " + ", ".join(f"{topic.split('.', 1)[1]} {written['records'].get(topic, 0):,} records "
                                  f"{nbytes / 1e6:,.1f} MB" for topic, nbytes in sorted(written["bytes"].items())))
    print(f"passthrough: {p['records_per_s']:,.0f} records/s ({p['records']:,} records the stage reads)")
    print(f"stage:       {s['records_per_s']:,.0f} records/s ({s['mb_per_s']:.1f} MB/s, "
          f"{s['groups_per_s']:.2f} groups/s, {s['canonical_tokens_per_s'] / 1e6:.2f} M canonical tokens/s)"
          f"  ratio {report['throughput_ratio']:.2f} (target >= 0.80, {mark('passthrough_ratio')})")
    print("stage fetched (librdkafka rxbytes): " + ", ".join(
        f"{topic.split('.', 1)[1]} {nbytes / 1e6:,.1f} MB" for topic, nbytes in sorted(s["fetched_bytes"].items())))
    if "consumed_share" in t:
        print(f"  fetched / written: {s['fetched_total_bytes'] / 1e6:,.1f} MB / {written['total_bytes'] / 1e6:,.1f} MB "
              f"= {t['consumed_share']['value']:.3f} (target <= {TARGET_CONSUMED_SHARE}, {mark('consumed_share')})")
    if "anchor" in report:
        a = report["anchor"]
        if a["kind"] == "no-routes":
            print(f"anchor, the workload without routes ({a['canonical_tokens'] / 1e6:.2f} M canonical tokens): "
                  f"{a['canonical_tokens_per_s'] / 1e6:.2f} M canonical tokens/s against "
                  f"{w['canonical_tokens'] / s['compared_seconds'] / 1e6:.2f} M with routes {route_staging}: "
                  f"{t['no_routes_ratio']['value']:.2f} (target >= {TARGET_NO_ROUTES_RATIO}, {mark('no_routes_ratio')})")
        else:
            print(f"anchor, the same groups with routes inline: {a['seconds_per_group']:.2f} s a group against "
                  f"{s['compared_seconds'] / w['groups']:.2f} s by reference: inline / by reference "
                  f"{t['inline_per_group_ratio']['value']:.2f} (target >= 1.0, {mark('inline_per_group_ratio')})")
        print(f"  runs after the first (medians compared), in order: " + ", ".join(
            f"{a['kind'] if name == 'anchor' else route_staging} {x:.2f}" for name, x in report["run_order"]) + " s")
    if latencies:
        ahead = report.get("latency_chunks_ahead")
        print(f"latency, last input record acknowledged -> the group's rows readable (read_committed), at "
              f"{lat['offered_groups_per_s']:.2f} groups/s (half of peak), {lat['groups']} groups"
              + (", route chunks written in the feed" if ahead else "") + ": "
              f"p50 {lat['p50_ms']:.0f} ms, p99 {lat['p99_ms']:.0f} ms "
              + ("(not judged: below)" if ahead else
                 f"(target p99 <= {lat['target_p99_ms']:.0f} ms, {mark('latency_p99_ms')})"))
        _print_inside(lat)
        if ahead and ahead["groups"]:
            print(f"  the same groups, their route chunks on the broker before the feed (as a rollout stages them "
                  f"while it runs), {ahead['groups']} groups: p50 {ahead['p50_ms']:.0f} ms, p99 {ahead['p99_ms']:.0f} ms "
                  f"(target p99 <= {ahead['target_p99_ms']:.0f} ms, {mark('latency_p99_ms')})")
            _print_inside(ahead)
    if "stage_profile" in report:
        from stage.bench.stage_profile import print_summary
        print_summary(report["stage_profile"])
    print(f"machine load after: {report['load_after']}")


def _print_inside(lat: dict) -> None:
    print("  inside the stage (bucket bounds): " + ", ".join(
        f"{name.replace('_seconds', '')} p50 <= {v['p50_le']:.0f} / p99 <= {v['p99_le']:.0f} ms"
        for name, v in lat["inside_stage_ms"].items()))
