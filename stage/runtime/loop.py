"""The stage's consumer loop: decode -> buffer -> finalize (worker pool) -> publish + commit.

One consumer in the group subscribes to the receipts topic with cooperative-sticky assignment;
for every receipts partition it is given it also assigns the same partition of the staged-calls
topic (co-partitioning: cooperative-sticky balances topic-partitions independently, so two
subscribed topics would not stay co-assigned). Offsets of both are committed through the same
transaction as the outputs.

The loop never blocks on finalization, the ledger, or the schema registry: groups are finalized
in a thread pool with a bounded number in flight, completed groups are published in batches (one
transaction each, on a publisher thread), newly assigned partitions stay paused while their
ledger loads on a loader thread, and a record whose schema is not resolved yet is put back while
the registry is asked on another thread. Every reason to stop fetching a partition is tracked
separately (stage.runtime.pauses).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from stage.buffer import PartitionBuffer, SystemClock
from stage.decode import InputLimits
from stage.publish import AtLeastOncePublisher, StageFatal, TransactionalPublisher
from stage.publish.deadletters import DeadLetter
from stage.routes import RouteDimsCache
from stage.runtime import exits
from stage.runtime.assignment import AssignmentSteps
from stage.runtime.availability import EndOffsetProbe, StartOffsets
from stage.runtime.clients import consumer_config, producer_config
from stage.config.model import EXACTLY_ONCE, StageConfig
from stage.runtime.deadlines import DeadlineSteps
from stage.runtime.intake import IntakeSteps
from stage.runtime.pauses import SHUTDOWN, PauseSet
from stage.runtime.probes import BrokerQueries
from stage.runtime.publication import PublicationSteps
from stage.runtime.registry import SchemaResolver
from stage.runtime.startup import connect_admin, probe_device, register_output_schemas
from stage.runtime.stats import RuntimeStats
from stage.runtime.topics import PartitionWatch
from stage.runtime.worker import Outputs
from stage.wire import AvroCodec, value_subject

logger = logging.getLogger(__name__)

OUTPUT_RECORDS = ("CanonicalRow", "RoutePlan", "GroupSummary", "LedgerEntry")
_TOPOLOGY_CHECK_S = 30.0


def _registry(cfg: StageConfig):
    if cfg.framing != "confluent":
        return None
    from confluent_kafka.schema_registry import SchemaRegistryClient
    # Lookups run on the resolver's thread, with its own back-off: no client-side retries.
    return SchemaRegistryClient({"url": cfg.schema_registry_url, "timeout": 10, "max.retries": 0})


def build_codecs(cfg: StageConfig) -> dict[str, AvroCodec]:
    registry = _registry(cfg)
    subjects = {"ReceiptEvent": cfg.topics.receipts, "StagedCall": cfg.topics.staged_calls,
                "CanonicalRow": cfg.topics.canonical_rows, "RoutePlan": cfg.topics.route_plans,
                "GroupSummary": cfg.topics.finalized_groups, "LedgerEntry": cfg.topics.stage_ledger}
    return {name: AvroCodec(name, framing=cfg.framing, registry=registry,
                            subject=value_subject(topic), max_record_bytes=cfg.max_record_bytes)
            for name, topic in subjects.items()}


class StageRuntime(IntakeSteps, DeadlineSteps, PublicationSteps, AssignmentSteps):
    """One consumer-group member: the state, the lifecycle and one iteration of the loop; the
    steps live in stage.runtime.intake, .deadlines, .publication and .assignment."""

    def __init__(self, cfg: StageConfig, *, clock=None, stats: RuntimeStats | None = None,
                 limits: InputLimits = InputLimits()) -> None:
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.stats = stats or RuntimeStats()
        self.stats.sink.configure(cfg)  # settings as gauges; alerted-on series created at 0
        self.limits = limits
        self.codecs = build_codecs(cfg)
        self.dims_cache = RouteDimsCache()
        self.topics = (cfg.topics.receipts, cfg.topics.staged_calls)
        self.buffers: dict[int, PartitionBuffer] = {}
        self.epochs: dict[int, int] = {}          # bumped whenever a partition is (re)assigned
        self.loading: dict[int, tuple[Future, int]] = {}   # partition -> ledger load, its epoch
        self.inflight: dict[tuple[int, str], Future] = {}
        self.waiting: list = []                   # (group, why, epoch) taken but not yet submitted
        self.done: list[Outputs] = []             # finalized, waiting for a transaction
        self.dead_letters: list[DeadLetter] = []  # for the next transaction
        self.tombstones: list = []
        # partition -> input topic -> highest offset dead-lettered (from the ledger, then ours)
        self.dl_watermarks: dict[int, dict[str, int]] = {}
        self.halted: dict[int, str] = {}          # partition -> why finalization stopped there
        self.held: dict[int, str] = {}            # partition -> why its due deadlines wait
        self.pauses = PauseSet(self.topics)
        self.resolver = SchemaResolver() if cfg.framing == "confluent" else None
        self._bp_paused = False
        self._blocked: set[tuple[str, int]] = set()   # put back during this consume batch
        self._fatal: exits.StageExit | None = None
        self._stop = threading.Event()
        self._last_commit = time.monotonic()
        self._offsets_dirty = False
        self.committed: dict[tuple[str, int], int] = {}   # (topic, partition) -> committed offset
        self.consumer: Consumer | None = None
        self.admin: AdminClient | None = None
        self.probe: EndOffsetProbe | None = None
        self.queries: BrokerQueries | None = None
        self.start_offsets: StartOffsets | None = None
        self.publisher = None
        self.partitions = 0
        self.pool = ThreadPoolExecutor(cfg.finalize_workers, thread_name_prefix="finalize")
        # One transaction at a time, off the loop thread: (future, outputs, batch) or None.
        self.publish_pool = ThreadPoolExecutor(1, thread_name_prefix="publish")
        # A load may wait out a stalled replica's open transaction: enough threads that one such
        # partition does not hold up the others' loads.
        self.loader_pool = ThreadPoolExecutor(8, thread_name_prefix="ledger")
        self._flight = None
        self._flight_started = 0.0
        self._topology = None
        self.health = None

    # -- lifecycle -------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def start(self) -> None:
        """Check everything that would fail every group (topics, device, schemas) before
        joining the group. Raises StageExit with the operator's message."""
        cfg = self.cfg
        logger.info("starting: bootstrap %s, group %s, %s, framing %s, finalize device %s, routes %s",
                    cfg.bootstrap_servers, cfg.group_id, cfg.processing, cfg.framing,
                    cfg.finalize.device, _routes_mode(cfg))
        self.admin, self.partitions = connect_admin(cfg)
        probe_device(cfg.finalize.device)
        register_output_schemas(self.codecs, OUTPUT_RECORDS, self._stop)
        producer = Producer(producer_config(cfg))
        self.publisher = (TransactionalPublisher(producer, cfg.transaction_timeout_ms / 1000)
                          if cfg.processing == EXACTLY_ONCE else AtLeastOncePublisher(producer))
        try:
            self.publisher.start()
        except StageFatal as error:
            raise exits.kafka_fatal(f"init_transactions failed: {error}") from None
        self.queries = BrokerQueries(cfg)
        self.probe = EndOffsetProbe(self.queries, self.clock.now_ms)
        self.start_offsets = StartOffsets(self.queries)
        consumer_conf = consumer_config(cfg)
        if cfg.statistics_interval_ms > 0:  # per-partition consumer lag for /metrics
            consumer_conf.setdefault("statistics.interval.ms", cfg.statistics_interval_ms)
            consumer_conf["stats_cb"] = self.stats.sink.librdkafka_stats
        self.consumer = Consumer(consumer_conf)
        # The staged-calls topic is assigned by hand (not subscribed): load its metadata now so
        # its partitions start fetching as soon as they are assigned.
        self.consumer.list_topics(cfg.topics.staged_calls, timeout=10)
        self.consumer.subscribe([cfg.topics.receipts], on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_lost)
        if cfg.metrics_port and self.health is None:
            from stage.observability import HealthServer
            self.health = HealthServer(self, cfg.metrics_port).start()
            logger.info("metrics and health on :%d (/metrics, /healthz, /readyz)", self.health.port)
        self._topology = PartitionWatch(self.queries, self.topics, self.partitions, _TOPOLOGY_CHECK_S)
        logger.info("stage started: %d partitions per topic, %s, transactional.id=%s; joining group %s",
                    self.partitions, cfg.processing, cfg.effective_transactional_id, cfg.group_id)

    def run(self, *, max_seconds: float | None = None) -> None:
        """Run until stop() (or SIGTERM with install_signal_handlers), then shut down cleanly."""
        if self.consumer is None:
            self.start()
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        try:
            while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
                self.step()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop fetching, finish what is in flight within the revoke budget, publish, close."""
        if self.consumer is None:
            return
        before = self.stats.total("groups_published")
        try:
            if self._fatal is None:
                for p in self._assigned():
                    self.pauses.hold(p, SHUTDOWN)
                self.pauses.apply(self.consumer, self._assigned())
                self._submit()
                self._drain(self.cfg.revoke_budget_ms / 1000)
                self._publish(force=True)
            self.consumer.close()  # leaves the group (the revoke callback publishes nothing new)
        except (StageFatal, exits.StageExit, KafkaException) as error:
            logger.error("shutdown could not publish what was finished: %s", error)
        finally:
            # A publication stuck inside the Kafka client is abandoned, not waited for.
            stuck = self._fatal is not None and self._fatal.abandon_threads
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.loader_pool.shutdown(wait=False, cancel_futures=True)
            self.publish_pool.shutdown(wait=not stuck)
            if self.resolver is not None:
                self.resolver.close()
            if self.queries is not None:
                self.queries.close()
            if not stuck:
                self.publisher.close()
            self.consumer = None
            if self.health is not None:
                self.health.stop()
                self.health = None
        flushed = self.stats.total("groups_published") - before
        unpublished = len(self.inflight) + len(self.waiting) + len(self.done) + sum(
            b.open_groups for b in self.buffers.values())
        logger.info("stopped: %d groups published on shutdown, %d in total; %d transactions committed, "
                    "%d aborted; %d groups left unpublished (re-read from the committed offsets by "
                    "the next owner); committed offsets %s", flushed,
                    self.stats.total("groups_published"), self.stats.total("transactions_committed"),
                    self.stats.total("transactions_aborted"), unpublished,
                    {f"{t}[{p}]": o for (t, p), o in sorted(self.committed.items())} or "unchanged")
        if self._fatal is not None and self._fatal.abandon_threads:
            raise self._fatal      # also after a SIGTERM: the caller must not join the stuck thread

    # -- one iteration ---------------------------------------------------------------------
    def step(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        messages = self.consumer.consume(num_messages=1000, timeout=self.cfg.poll_timeout_ms / 1000)
        now = self.clock.now_ms()
        self._blocked.clear()
        for msg in messages:
            self._intake(msg, now)
        self._finish_loads()
        self._resolve_schemas()
        self._take_ready(now)
        self._submit()
        self._collect()
        self._publish()
        self._backpressure()
        self._check_topology()
        self.pauses.apply(self.consumer, self._assigned())
        self.stats.set("paused_partitions", self.pauses.paused_count)
        self.stats.set("inflight_groups", len(self.inflight) + len(self.done) + len(self.waiting))
        self.stats.set("schema_registry_unavailable", 1.0 if self.resolver and self.resolver.unavailable else 0.0)
        self.stats.heartbeat()
        if self._fatal is not None:
            raise self._fatal

    def _assigned(self) -> list[int]:
        return sorted(set(self.buffers) | set(self.loading))

    # -- readiness -------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        if not self._assigned():
            return False, "no partitions assigned"
        if self.loading:
            return False, f"loading the ledger of partitions {sorted(self.loading)}"
        if self.halted:
            return False, "partitions halted: " + "; ".join(f"{p}: {why}" for p, why in sorted(self.halted.items()))
        if self.resolver is not None and self.resolver.unavailable:
            return False, f"schema registry unavailable: {self.resolver.last_error}"
        return True, f"{len(self.buffers)} partitions assigned"

    @property
    def ready(self) -> bool:
        return self.readiness()[0]


def _routes_mode(cfg: StageConfig) -> str:
    if not cfg.finalize.router_replay:
        return "off"
    return "deferred" if cfg.finalize.defer_routes else "direct"


__all__ = ["StageRuntime", "build_codecs", "OUTPUT_RECORDS"]
