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

Where things live: everything about one assigned partition is its ``PartitionState``
(stage.runtime.partition); one iteration runs the steps in order, each a collaborator handed
what it may touch: intake (decode, route check, buffer or dead-letter), loads (ledger loads),
deadlines (take ready groups), finalization (the worker pool), publication (the transaction in
flight), backpressure, and the topology watch; assignment handles rebalances and the rewind.
"""

from __future__ import annotations

import logging
import re
import signal
import tempfile
import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

from confluent_kafka import Consumer, KafkaException, Producer

from stage.buffer import SystemClock
from stage.buffer.spill import SpillDirError, prepare_spill_root
from stage.config.model import EXACTLY_ONCE, StageConfig
from stage.decode import InputLimits
from stage.publish import AtLeastOncePublisher, StageFatal, TransactionalPublisher
from stage.routes import RouteDimsCache
from stage.runtime import exits
from stage.runtime.assignment import Assignment, repartitioned
from stage.runtime.availability import EndOffsetProbe, StartOffsets
from stage.runtime.backpressure import BackPressure
from stage.runtime.clients import Clients, consumer_config, producer_config
from stage.runtime.deadlines import Deadlines
from stage.runtime.detached import DetachedWorker
from stage.runtime.finalization import Finalization
from stage.runtime.intake import Intake
from stage.runtime.loads import LedgerLoads
from stage.runtime.memory import Holdings
from stage.runtime.partition import Partitions
from stage.runtime.pauses import SHUTDOWN, PauseSet
from stage.runtime.probes import BrokerQueries
from stage.runtime.publication import Publication
from stage.runtime.registry import SchemaResolver, build_codecs
from stage.runtime.startup import connect_admin, probe_device, register_output_schemas
from stage.runtime.stats import RuntimeStats
from stage.runtime.topics import PartitionWatch
from stage.runtime.workers import make_workers

logger = logging.getLogger(__name__)

OUTPUT_RECORDS = ("CanonicalRow", "RoutePlan", "GroupSummary", "LedgerEntry")
_TOPOLOGY_CHECK_S = 30.0


class StageRuntime:
    """One consumer-group member: the lifecycle, the cross-partition pieces (clients, worker
    pools, the transaction in flight) and one iteration of the loop. What belongs to an input
    partition is its ``PartitionState`` (stage.runtime.partition); each step is a collaborator
    that is handed what it may touch."""

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
        self.partition_count = 0          # of every co-partitioned topic, checked at start
        self.clients = Clients()
        self.partitions = Partitions()
        self.pauses = PauseSet(self.topics)
        self.resolver = SchemaResolver() if cfg.framing == "confluent" else None
        self.partitions.on_drop(self.pauses.forget)
        if self.resolver is not None:
            self.partitions.on_drop(self.resolver.forget)
        self._fatal: exits.StageExit | None = None
        self._stop = threading.Event()
        # Finalization: threads of this process or worker processes (stage.runtime.workers).
        self.pool = make_workers(cfg, limits=limits, task=dict(
            config=cfg.finalize, dims_cache=self.dims_cache, codecs=self.codecs, topics=cfg.topics,
            limits=limits, now_ms=self.clock.now_ms))
        # One transaction at a time, off the loop thread (a stuck one can be walked away from).
        self.publish_pool = DetachedWorker("publish")
        # A load may wait out a stalled replica's open transaction: enough threads that one such
        # partition does not hold up the others' loads.
        self.loader_pool = ThreadPoolExecutor(8, thread_name_prefix="ledger")
        self._topology = None
        self.health = None
        self.spill_root = spill_root(cfg)
        self._build_steps()

    def _build_steps(self) -> None:
        cfg, parts, stats = self.cfg, self.partitions, self.stats
        rewind = lambda: self.assignment.rewind()  # noqa: E731 - the assignment is made below
        self.loads = LedgerLoads(cfg, pool=self.loader_pool, ledger_codec=self.codecs["LedgerEntry"],
                                 partitions=parts, pauses=self.pauses, clients=self.clients,
                                 stop=self._stop, spill_root=self.spill_root)
        self.intake = Intake(topics=cfg.topics, codecs=self.codecs, limits=self.limits,
                             keep_routes=cfg.finalize.direct_routes,
                             partition_count=lambda: self.partition_count, partitions=parts,
                             pauses=self.pauses, resolver=self.resolver, clients=self.clients,
                             stats=stats, rewind=rewind,
                             room=lambda: cfg.max_buffered_bytes - self.holdings().total)
        self.deadlines = Deadlines(topics=self.topics, hold_max_ms=cfg.deadline_hold_max_ms,
                                   partitions=parts, pauses=self.pauses, clients=self.clients,
                                   stats=stats)
        self.finalization = Finalization(
            workers=self.pool, max_inflight=cfg.max_inflight_groups, routes_mode=_routes_mode(cfg),
            partitions=parts, pauses=self.pauses, stats=stats,
            room=lambda: cfg.max_buffered_bytes - self.holdings().total,
            idle=lambda: not self.publication.in_flight)
        self.publication = Publication(cfg, pool=self.publish_pool, clients=self.clients,
                                       ledger_codec=self.codecs["LedgerEntry"], clock=self.clock,
                                       partitions=parts, stats=stats, rewind=rewind,
                                       declare_fatal=self._declare_fatal,
                                       new_publisher=(self._new_publisher
                                                      if cfg.processing == EXACTLY_ONCE else None))
        self.assignment = Assignment(cfg, partition_count=lambda: self.partition_count,
                                     partitions=parts, pauses=self.pauses, loads=self.loads,
                                     finalization=self.finalization, publish=self._publish,
                                     clients=self.clients, stats=stats, fatal=lambda: self._fatal,
                                     declare_fatal=self._declare_fatal)
        self.backpressure = BackPressure(
            cfg, partitions=parts, pauses=self.pauses, stats=stats, holdings=self.holdings,
            busy=lambda: self.finalization.busy or self.publication.in_flight)

    def holdings(self) -> Holdings:
        """What the stage holds for unpublished groups, by where (stage.runtime.memory)."""
        return Holdings(buffered=sum(s.buffered_bytes for s in self.partitions),
                        finalizing=self.finalization.working_bytes,
                        outputs=sum(s.output_bytes for s in self.partitions),
                        publishing=self.publication.publishing_bytes,
                        spilled=sum(s.spilled_bytes for s in self.partitions))

    def _declare_fatal(self, fatal: exits.StageExit) -> None:
        self._fatal = fatal

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
        self._serve_health()    # first: a port in use is a configuration error, said at once
        try:
            if self.spill_root is not None:   # private (0700), emptied of what an earlier run left
                try:
                    prepare_spill_root(self.spill_root)
                except SpillDirError as error:
                    raise exits.StageExit(exits.EXIT_CONFIG, f"configuration error: {error}") from None
            self._start_clients()
        except BaseException:
            if self.health is not None:
                self.health.stop()
                self.health = None
            raise

    def _serve_health(self) -> None:
        port = self.cfg.metrics_port
        if not port or self.health is not None:
            return
        from stage.observability import HealthServer
        try:
            self.health = HealthServer(self, port).start()
        except OSError as error:
            raise exits.StageExit(exits.EXIT_CONFIG, (
                f"configuration error: metrics_port {port} is in use ({error.strerror}; another stage "
                f"on this host?): set metrics_port, or ROLLOUT_REASSEMBLER_METRICS_PORT, to a free "
                "port, or 0 for no /metrics, /healthz and /readyz")) from None
        logger.info("metrics and health on :%d (/metrics, /healthz, /readyz)", self.health.port)

    def _start_clients(self) -> None:
        cfg, clients = self.cfg, self.clients
        clients.admin, self.partition_count = connect_admin(cfg)
        probe_device(cfg.finalize.device)
        register_output_schemas(self.codecs, OUTPUT_RECORDS, self._stop)
        self.pool.warm()        # worker processes started before the group is joined
        try:
            clients.publisher = self._new_publisher()
        except StageFatal as error:
            raise exits.kafka_fatal(f"init_transactions failed: {error}") from None
        clients.queries = BrokerQueries(cfg)
        clients.probe = EndOffsetProbe(clients.queries, self.clock.now_ms)
        clients.start_offsets = StartOffsets(clients.queries)
        consumer_conf = consumer_config(cfg)
        if cfg.statistics_interval_ms > 0:  # per-partition consumer lag for /metrics
            consumer_conf.setdefault("statistics.interval.ms", cfg.statistics_interval_ms)
            consumer_conf["stats_cb"] = self.stats.sink.librdkafka_stats
        clients.consumer = Consumer(consumer_conf)
        # The staged-calls topic is assigned by hand (not subscribed): load its metadata now so
        # its partitions start fetching as soon as they are assigned.
        clients.consumer.list_topics(cfg.topics.staged_calls, timeout=10)
        clients.consumer.subscribe([cfg.topics.receipts], on_assign=self._on_assign,
                                   on_revoke=self._on_revoke, on_lost=self._on_lost)
        self._topology = PartitionWatch(clients.queries, self.topics, self.partition_count,
                                        _TOPOLOGY_CHECK_S)
        logger.info("stage started: %d partitions per topic, %s, transactional.id=%s; joining group %s",
                    self.partition_count, cfg.processing, cfg.effective_transactional_id, cfg.group_id)

    def _new_publisher(self):
        """A started publisher: in exactly-once mode init_transactions, which fences any earlier
        producer with this transactional.id (a stuck one, on a recovery) and aborts its open
        transaction."""
        cfg = self.cfg
        producer = Producer(producer_config(cfg))
        publisher = (TransactionalPublisher(producer, cfg.transaction_timeout_ms / 1000)
                     if cfg.processing == EXACTLY_ONCE else AtLeastOncePublisher(producer))
        publisher.start()
        return publisher

    def run(self, *, max_seconds: float | None = None) -> None:
        """Run until stop() (or SIGTERM with install_signal_handlers), then shut down cleanly."""
        if self.clients.consumer is None:
            self.start()
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        try:
            while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
                self.step()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop fetching, finish what is in flight within the revoke budget, publish, close."""
        consumer = self.clients.consumer
        if consumer is None:
            return
        before = self.stats.total("groups_published")
        try:
            if self._fatal is None:
                for p in self.partitions.numbers():
                    self.pauses.hold(p, SHUTDOWN)
                self.pauses.apply(consumer, self.partitions.numbers())
                self.finalization.submit()
                self.finalization.drain(self.cfg.revoke_budget_ms / 1000)
                self._publish(force=True)
            consumer.close()  # leaves the group (the revoke callback publishes nothing new)
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
            if self.clients.queries is not None:
                self.clients.queries.close()
            if not stuck:
                self.clients.publisher.close()
            self.clients.consumer = None
            for state in self.partitions:
                state.release_buffer()
            if self.health is not None:
                self.health.stop()
                self.health = None
        flushed = self.stats.total("groups_published") - before
        logger.info("stopped: %d groups published on shutdown, %d in total; %d transactions committed, "
                    "%d aborted; %d groups left unpublished (re-read from the committed offsets by "
                    "the next owner); committed offsets %s", flushed,
                    self.stats.total("groups_published"), self.stats.total("transactions_committed"),
                    self.stats.total("transactions_aborted"), self._unpublished(),
                    self.publication.committed_offsets() or "unchanged")
        if self._fatal is not None and self._fatal.abandon_threads:
            raise self._fatal      # also after a SIGTERM: the caller must not join the stuck thread

    def _unpublished(self) -> int:
        parts = self.partitions
        return (len(self.finalization.inflight) + parts.queued("waiting") + parts.queued("done")
                + sum(s.open_groups for s in parts))

    # -- one iteration ---------------------------------------------------------------------
    def step(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        consumer = self.clients.consumer
        messages = consumer.consume(num_messages=1000, timeout=self.cfg.poll_timeout_ms / 1000)
        now = self.clock.now_ms()
        self.intake.batch(messages, now)
        self.loads.finish()
        self.intake.resolve_schemas()
        self.deadlines.take_ready(now)
        self.finalization.submit()
        self.finalization.collect()
        self._publish()
        self.backpressure.apply()
        self._check_topology()
        self.pauses.apply(consumer, self.partitions.numbers())
        self.stats.set("paused_partitions", self.pauses.paused_count)
        self.stats.set("inflight_groups", len(self.finalization.inflight)
                       + self.partitions.queued("done") + self.partitions.queued("waiting"))
        self.stats.set("schema_registry_unavailable", 1.0 if self.resolver and self.resolver.unavailable else 0.0)
        self.stats.heartbeat()
        if self._fatal is not None:
            raise self._fatal

    def _publish(self, force: bool = False) -> None:
        self.publication.publish(force)

    def _check_topology(self) -> None:
        if self._topology is None or self._fatal is not None:
            return
        changed = self._topology.poll()
        if changed:
            topic, count = changed
            self._fatal = repartitioned(topic, self.partition_count, count)

    # -- rebalance callbacks (registered with the consumer) --------------------------------
    def _on_assign(self, consumer, partitions) -> None:
        self.assignment.on_assign(consumer, partitions)

    def _on_revoke(self, consumer, partitions) -> None:
        self.assignment.on_revoke(consumer, partitions)

    def _on_lost(self, consumer, partitions) -> None:
        self.assignment.on_lost(consumer, partitions)

    # -- what it holds, for readiness, tests and operators ---------------------------------
    @property
    def consumer(self):
        return self.clients.consumer

    @property
    def publisher(self):
        return self.clients.publisher

    @property
    def buffers(self) -> dict:
        """Partition -> its buffer, for the partitions whose ledger has loaded."""
        return {s.number: s.buffer for s in self.partitions.loaded()}

    @property
    def halted(self) -> dict[int, str]:
        """Partition -> why finalization stopped there."""
        return {s.number: s.halted for s in self.partitions if s.halted is not None}

    def readiness(self) -> tuple[bool, str]:
        if not len(self.partitions):
            return False, "no partitions assigned"
        loading = self.loads.loading
        if loading:
            return False, f"loading the ledger of partitions {loading}"
        halted = self.halted
        if halted:
            return False, "partitions halted: " + "; ".join(f"{p}: {why}" for p, why in sorted(halted.items()))
        if self.resolver is not None and self.resolver.unavailable:
            return False, f"schema registry unavailable: {self.resolver.last_error}"
        stuck = self.publication.stuck()
        if stuck is not None:
            return False, stuck
        pairs = len(self.partitions)
        return True, (f"{pairs} partitions assigned: {2 * pairs} topic-partitions "
                      "(receipts and staged calls, as the assigned_partitions gauge counts them)")

    @property
    def ready(self) -> bool:
        return self.readiness()[0]


def spill_root(cfg: StageConfig) -> Path | None:
    """This replica's spill directory (stage.buffer.spill), None when spilling is off."""
    if cfg.max_spill_bytes <= 0:
        return None
    name = re.sub(r"[^A-Za-z0-9._-]", "_", cfg.effective_transactional_id)
    return Path(cfg.spill_dir or tempfile.gettempdir()) / f"rollout-reassembler-spill-{name}"


def _routes_mode(cfg: StageConfig) -> str:
    if not cfg.finalize.router_replay:
        return "off"
    return "deferred" if cfg.finalize.defer_routes else "direct"


__all__ = ["OUTPUT_RECORDS", "StageRuntime", "build_codecs"]
