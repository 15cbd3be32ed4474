"""The stage's consumer loop: decode -> buffer -> finalize (worker pool) -> publish + commit.

One consumer in the group subscribes to the lead input topic (receipts) with cooperative-sticky
assignment; for every partition it is given it also assigns the same partition of every other
input topic (co-partitioning, stage.runtime.state.inputs: cooperative-sticky balances
topic-partitions independently, so two subscribed topics would not stay co-assigned). Offsets
of every input are committed through the same transaction as the outputs.

The loop never blocks on finalization, the ledger, or the schema registry: groups are finalized
in a worker pool with a bounded number in flight, completed groups are published in batches (one
transaction each, on a publisher thread), newly assigned partitions are not fetched while their
ledger loads on a loader thread, and a record whose schema is not resolved yet is put back while
the registry is asked on another thread.

Where things live (docs/design.md, Code layout): ``state/`` holds what is known about the
assigned partitions (``PartitionState``: identity, epoch, buffer, committed offsets, dead-letter
marks), the input table, the pause reasons and the memory accounting; ``steps/`` the steps, each
a class that owns its state and its inbox and hands typed work on (intake -> loads -> deadlines
-> finalization -> publication, with back-pressure and assignment); ``kafka/`` the clients and
broker queries; ``task/`` what runs on a finalize worker. This class runs one iteration, hands
each step's output to the next, derives the pause reasons and the gauges from the state once an
iteration, and handles the steps' outcomes (``Rewind``, ``StageExit``) in one place.
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
from functools import partial

from confluent_kafka import Consumer, KafkaException, Producer

from stage.buffer import SystemClock
from stage.buffer.spill import SpillDirError, prepare_spill_root
from stage.config.model import EXACTLY_ONCE, StageConfig
from stage.decode import InputLimits
from stage.publish import AtLeastOncePublisher, StageFatal, TransactionalPublisher
from stage.routes import RouteDimsCache
from stage.runtime import exits
from stage.runtime.detached import DetachedWorker
from stage.runtime.gauges import Gauges
from stage.runtime.kafka.availability import EndOffsetProbe, StartOffsets
from stage.runtime.kafka.clients import Clients, consumer_config, producer_config, static_member_id
from stage.runtime.kafka.fetchstates import FetchStates
from stage.runtime.kafka.health import BrokerHealth
from stage.runtime.kafka.liveness import BrokerLiveness
from stage.runtime.kafka.probes import BrokerQueries
from stage.runtime.kafka.registry import SchemaResolver, build_codecs
from stage.runtime.kafka.startup import connect_admin, probe_device, register_output_schemas
from stage.runtime.kafka.topics import PartitionWatch
from stage.runtime.state.inputs import LEAD, alongside, input_kinds, input_topics
from stage.runtime.state.memory import Holdings, finalize_reserve
from stage.runtime.state.partition import Partitions
from stage.runtime.state.pauses import PauseSet, reasons_of
from stage.runtime.stats import RuntimeStats
from stage.runtime.steps.assignment import Assignment, repartitioned
from stage.runtime.steps.backpressure import BackPressure
from stage.runtime.steps.deadlines import Deadlines
from stage.runtime.steps.finalization import Finalization
from stage.runtime.steps.flight import Flight
from stage.runtime.steps.intake import Intake
from stage.runtime.steps.loads import LedgerLoads
from stage.runtime.steps.outcomes import Budget, ConsumerFenced, Rewind
from stage.runtime.steps.publication import Publication
from stage.runtime.task.pools import make_workers
from stage.runtime.task.finalize_task import stage_limits
from stage.wire import OUTPUT_RECORDS

logger = logging.getLogger(__name__)

_TOPOLOGY_CHECK_S = 30.0
_LEAVE_S = 5.0   # a static member's revoke before it leaves, at most
LIVENESS_STATS_MS = 1000   # the consumer's statistics: how long since each broker answered it


class StageRuntime:
    """One consumer-group member: the lifecycle, the cross-partition pieces (clients, worker
    pools), and one iteration of the loop, which hands each step's work to the next."""

    def __init__(self, cfg: StageConfig, *, clock=None, stats: RuntimeStats | None = None,
                 limits: InputLimits = InputLimits()) -> None:
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.stats = stats or RuntimeStats()
        self.stats.sink.configure(cfg)  # settings as gauges; alerted-on series created at 0
        self.codecs = build_codecs(cfg)
        # the route topic and chunk cap of this stage: intake (which chunks a group waits for)
        # and finalization check a call's routes_ref against the same bounds
        self.limits = limits = stage_limits(limits, cfg.topics, self.codecs)
        self.dims_cache = RouteDimsCache()
        self.kinds = input_kinds(cfg)      # the input table of this mode (direct routes: 3 inputs)
        self.topics = input_topics(cfg.topics, self.kinds)
        self.clients = Clients()
        self.broker_health = BrokerHealth()   # told by the consumer's error callback and the liveness
        self.liveness: BrokerLiveness | None = None   # asks the brokers every second (silent partitions)
        self._lag_reported = 0.0                  # when the statistics last went to /metrics
        self._fetch_states = FetchStates()        # the consumer's fetch states, logged at DEBUG
        self._fenced_consumers: list = []         # replaced consumers, closed at shutdown
        self.partitions = Partitions()
        self.pauses = PauseSet(self.topics)
        self.resolver = SchemaResolver() if cfg.framing == "confluent" else None
        self._fatal: exits.StageExit | None = None
        self._stopping = False
        self._stop = threading.Event()
        # Finalization: threads of this process or worker processes (stage.runtime.task.pools).
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
        self.loads = LedgerLoads(cfg, pool=self.loader_pool, ledger_codec=self.codecs["LedgerEntry"],
                                 partitions=parts, clients=self.clients, stop=self._stop,
                                 spill_root=self.spill_root)
        self.intake = Intake(topics=cfg.topics, codecs=self.codecs, limits=self.limits,
                             keep_routes=cfg.finalize.direct_routes, partitions=parts,
                             resolver=self.resolver, clients=self.clients, stats=stats,
                             transactional_id=cfg.effective_transactional_id, kinds=self.kinds)
        self.deadlines = Deadlines(topics=self.topics, hold_max_ms=cfg.deadline_hold_max_ms,
                                   partitions=parts, clients=self.clients, stats=stats)
        self.finalization = Finalization(workers=self.pool, max_inflight=cfg.max_inflight_groups,
                                         routes_mode=_routes_mode(cfg), partitions=parts, stats=stats)
        self.flight = Flight(cfg, pool=self.publish_pool, stats=stats, new_publisher=self._new_publisher,
                             recover=cfg.processing == EXACTLY_ONCE, health=self.broker_health)
        self.publication = Publication(cfg, flight=self.flight, ledger_codec=self.codecs["LedgerEntry"],
                                       clock=self.clock, partitions=parts, stats=stats)
        self.assignment = Assignment(cfg, partitions=parts, clients=self.clients, stats=stats)
        self.backpressure = BackPressure(cfg)

    @property
    def partition_count(self) -> int:
        """Of every input topic, checked at start; records are routed by it."""
        return self.intake.partition_count

    @partition_count.setter
    def partition_count(self, count: int) -> None:
        self.intake.partition_count = count

    def holdings(self) -> Holdings:
        """What the stage holds for unpublished groups, by where (stage.runtime.state.memory)."""
        return Holdings(buffered=sum(s.buffered_bytes for s in self.partitions),
                        finalizing=self.finalization.working_bytes,
                        outputs=self.publication.output_bytes,
                        publishing=self.publication.publishing_bytes,
                        spilled=sum(s.spilled_bytes for s in self.partitions))

    def budget(self) -> Budget:
        """The snapshot the steps that must not exceed the caps are given."""
        in_flight = self.publication.in_flight
        cap = self.cfg.max_buffered_bytes
        largest = max((s.largest_group_bytes for s in self.partitions), default=0)
        return Budget(room=cap - self.holdings().total,
                      reserve=finalize_reserve(largest, self.finalization.routes_mode, cap),
                      busy=self.finalization.busy or bool(self.publication.done) or in_flight,
                      idle=not in_flight)

    # -- lifecycle -------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.stop()

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
        clients.admin, self.partition_count = connect_admin(cfg, self._stop, self.stats.heartbeat)
        probe_device(cfg.finalize.device)
        register_output_schemas(self.codecs, OUTPUT_RECORDS, self._stop)
        self.pool.warm()        # worker processes started before the group is joined
        try:
            self.flight.start()
        except StageFatal as error:
            raise exits.kafka_fatal(f"init_transactions failed: {error}") from None
        clients.queries = BrokerQueries(cfg)
        clients.probe = EndOffsetProbe(clients.queries, self.clock.now_ms)
        clients.start_offsets = StartOffsets(clients.queries)
        self.liveness = BrokerLiveness(partial(clients.queries.ask_metadata, LEAD.topic(cfg.topics)),
                                       self.broker_health).start()
        clients.consumer = self._new_consumer()
        self._topology = PartitionWatch(clients.queries, self.topics, self.partition_count,
                                        _TOPOLOGY_CHECK_S)
        logger.info("stage started: %d partitions per topic, %s, transactional.id=%s; joining group %s",
                    self.partition_count, cfg.processing, cfg.effective_transactional_id, cfg.group_id)

    def _new_consumer(self) -> Consumer:
        """A consumer subscribed to the lead input topic, with the rebalance callbacks."""
        consumer = Consumer(self._consumer_config())
        # The other inputs are assigned by hand (not subscribed): load their metadata now so
        # their partitions start fetching as soon as they are assigned.
        for topic in alongside(self.cfg.topics, self.kinds):
            consumer.list_topics(topic, timeout=10)
        consumer.subscribe([LEAD.topic(self.cfg.topics)], on_assign=self._on_assign,
                           on_revoke=self._on_revoke, on_lost=self._on_lost)
        return consumer

    def _replace_consumer(self, why: str) -> None:
        """The consumer is fenced for good (a static member whose own JoinGroup, held by a
        network partition and delivered late, made the coordinator see two members with its
        id): its partitions go as lost ones do (nothing of theirs is published: the new owner
        re-reads them), and a new consumer joins with the same settings. The fenced one is
        kept, not closed, until shutdown: a transaction in flight may still hold it."""
        numbers = self.partitions.numbers()
        self.stats.inc("rebalances", kind="lost")
        self._forget(numbers, dropped=True)
        self.partitions.drop(numbers)
        self.assignment.track()
        self.pauses.apply(self.clients.consumer, self._pause_reasons())   # nothing assigned: no call
        self._fenced_consumers.append(self.clients.consumer)
        logger.warning("the consumer was fenced (%s): its partitions %s are dropped as lost ones, the "
                       "new owner re-reads them; joining the group again with a new consumer", why, numbers)
        self.clients.consumer = self._new_consumer()
        self._set_gauges()

    def _consumer_config(self) -> dict:
        """The consumer's settings with the runtime's callbacks: statistics (every second, for
        the brokers' liveness; per-partition lag for /metrics every ``statistics_interval_ms``)
        and errors (every broker down: stage.runtime.kafka.health)."""
        conf = consumer_config(self.cfg)
        lag_ms = self.cfg.statistics_interval_ms or LIVENESS_STATS_MS
        conf.setdefault("statistics.interval.ms", min(lag_ms, LIVENESS_STATS_MS))
        conf["stats_cb"] = self._on_statistics
        conf["error_cb"] = self.broker_health.error_callback("consumer")
        return conf

    def _on_statistics(self, stats_json: str) -> None:
        if self.liveness is not None:
            self.liveness.consumer_stats(stats_json)
        if logger.isEnabledFor(logging.DEBUG):
            line = self._fetch_states.changed(stats_json)
            if line is not None:
                logger.debug("consumer fetch states: %s", line)
        interval = self.cfg.statistics_interval_ms / 1000
        now = time.monotonic()
        if interval > 0 and now - self._lag_reported >= interval * 0.9:
            self._lag_reported = now
            self.stats.sink.librdkafka_stats(stats_json)

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
                self._stopping = True
                self.pauses.apply(consumer, self._pause_reasons())
                self.finalization.submit(self.budget(), len(self.publication.done))
                self.publication.offer(self.finalization.drain(self.cfg.revoke_budget_ms / 1000))
                try:
                    self._publish(force=True)
                except Rewind as why:
                    logger.warning("shutdown: %s; the next owner re-reads from the committed offsets", why)
            if static_member_id(self.cfg) is not None:
                self._leave(consumer)
            consumer.close()  # leaves the group (the revoke callback publishes nothing new)
        except (StageFatal, exits.StageExit, KafkaException) as error:
            logger.error("shutdown could not publish what was finished: %s", error)
        finally:
            # A publication stuck inside the Kafka client is abandoned, not waited for; and
            # nothing here may replace the error the stage stops with (a fenced producer's
            # flush raises): each step is logged, not raised.
            stuck = self._fatal is not None and self._fatal.abandon_threads
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.loader_pool.shutdown(wait=False, cancel_futures=True)
            self.publish_pool.shutdown(wait=not stuck)
            # before the client its requests use is closed
            _quietly("stopping the broker liveness requests", self.liveness and self.liveness.stop)
            _quietly("closing the schema registry client", self.resolver and self.resolver.close)
            _quietly("closing the broker queries", self.clients.queries and self.clients.queries.close)
            for fenced in self._fenced_consumers:
                _quietly("closing a fenced consumer", fenced.close)
            if not stuck:
                _quietly("closing the producer", self.flight.close)
            self.clients.consumer = None
            for state in self.partitions:
                state.close()
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

    def _leave(self, consumer) -> None:
        """A static member leaves the group only when it unsubscribes (librdkafka sends no
        LeaveGroup for one that just closes): unsubscribe, serve the revoke, then close."""
        try:
            consumer.unsubscribe()
            deadline = time.monotonic() + _LEAVE_S
            while len(self.partitions) and time.monotonic() < deadline:
                consumer.poll(0.05)     # serves the revoke callback; records are not taken
            consumer.poll(0.05)         # the LeaveGroup request goes out once unassigned
        except KafkaException as error:   # fenced, or no coordinator: the session expires instead
            logger.warning("leaving the group: %s", error.args[0])

    def _unpublished(self) -> int:
        fin = self.finalization
        return (len(fin.inflight) + len(fin.waiting) + len(self.publication.done)
                + sum(s.open_groups for s in self.partitions))

    # -- one iteration ---------------------------------------------------------------------
    def step(self) -> None:
        """One iteration; the steps' outcomes are handled here: a ``Rewind`` starts every
        partition over, a ``StageExit`` stops the stage (raised again by every later step)."""
        if self._fatal is not None:
            raise self._fatal
        try:
            self._iterate()
        except Rewind as why:
            self._rewind(why)
            self._settle()
        except ConsumerFenced as why:
            self._replace_consumer(str(why))
        except exits.StageExit as fatal:
            self._fatal = fatal
            raise
        self.stats.heartbeat()
        if self._fatal is not None:
            raise self._fatal

    def _iterate(self) -> None:
        messages = self.clients.consumer.consume(num_messages=1000,
                                                 timeout=self.cfg.poll_timeout_ms / 1000)
        now = self.clock.now_ms()
        taken = self.intake.batch(messages, now, self.budget())
        self.publication.offer_dead_letters(taken.dead_letters)
        self.publication.offsets_moved(taken.moved)
        self.publication.tell_outcomes(self.loads.finish())
        if self.resolver is not None:
            self.resolver.poll()        # partitions whose schemas resolved fetch again
        ready, moved = self.deadlines.take_ready(now, self._pause_reasons())
        self.finalization.offer(ready)
        self.publication.offsets_moved(moved)
        self.finalization.submit(self.budget(), len(self.publication.done))
        self.publication.offer(self.finalization.poll())
        self._publish()
        budget = self.budget()
        self.backpressure.apply(self.holdings(), sum(s.open_groups for s in self.partitions), budget.busy)
        self._check_topology()
        self._settle()

    def _settle(self) -> None:
        """Apply this iteration's pause reasons in the consumer and publish the gauges."""
        if self.clients.consumer is not None:
            self.pauses.apply(self.clients.consumer, self._pause_reasons())
        self._set_gauges()

    def _pause_reasons(self) -> dict:
        pending = self.resolver.pending if self.resolver is not None else frozenset()
        return reasons_of(self.partitions, registry_pending=pending, halted=self.finalization.halted,
                          backpressure=self.backpressure.paused, stopping=self._stopping)

    def _set_gauges(self) -> None:
        fin, pub = self.finalization, self.publication
        gauges = Gauges(
            held=self.holdings(), open_groups=sum(s.open_groups for s in self.partitions),
            paused_partitions=self.pauses.paused_count,
            assigned_partitions=len(self.topics) * len(self.partitions),
            inflight_groups=len(fin.inflight) + len(fin.waiting) + len(pub.done),
            halted_partitions=len(fin.halted), deadline_held_partitions=len(self.deadlines.held),
            schema_registry_unavailable=self.resolver is not None and self.resolver.unavailable)
        for name, value in gauges.values().items():
            self.stats.set(name, value)

    def _publish(self, force: bool = False) -> None:
        """The publication step; a StageExit it raises is remembered (shutdown then publishes
        nothing more and does not join a stuck thread)."""
        try:
            self.publication.publish(self.clients.consumer, force)
        except exits.StageExit as fatal:
            self._fatal = fatal
            raise

    def _rewind(self, why) -> None:
        """After an aborted or replaced transaction (or a failed seek): forget all derived
        state and re-read every assigned partition from its committed offsets (its ledger is
        reloaded too)."""
        logger.warning("rewinding every partition to its committed offsets (%s)", why)
        numbers = self.partitions.numbers()
        self._forget(numbers)
        for p in numbers:
            self.loads.start(p)
        if self.clients.consumer is not None:
            self.pauses.apply(self.clients.consumer, self._pause_reasons())
            self.assignment.seek_committed()

    def _forget(self, numbers, *, dropped: bool = False) -> None:
        """What the steps hold for these partitions goes: they left (``dropped``) or are
        reloaded."""
        self.finalization.forget(numbers)
        self.publication.forget(numbers)
        if dropped:
            self.deadlines.forget(numbers)
            if self.resolver is not None:
                self.resolver.forget(numbers)
            if self.clients.start_offsets is not None:
                for topic in self.topics:
                    for p in numbers:
                        self.clients.start_offsets.forget(topic, p)

    def _check_topology(self) -> None:
        if self._topology is None or self._fatal is not None:
            return
        changed = self._topology.poll()
        if changed:
            topic, count = changed
            self._fatal = repartitioned(topic, self.partition_count, count)

    # -- rebalance callbacks (registered with the consumer) --------------------------------
    def _on_assign(self, consumer, partitions) -> None:
        self.stats.inc("rebalances", kind="assign")
        new = self.assignment.add(partitions)
        beyond = [p for p in new if p >= self.partition_count]
        if beyond and self._fatal is None:
            self._fatal = repartitioned(LEAD.topic(self.cfg.topics), self.partition_count, max(beyond) + 1)
        for p in new:
            self.loads.start(p)
        self.assignment.assign(consumer, partitions)
        self.pauses.apply(consumer, self._pause_reasons())   # loading partitions fetch nothing yet
        self._set_gauges()
        logger.info("assigned partitions %s (now holding %s); loading their ledgers", new,
                    self.partitions.numbers())

    def _on_revoke(self, consumer, partitions) -> None:
        """Cooperative revoke: publish what is finished for these partitions within the budget
        (the new owner re-reads the rest from the committed offsets), then let them go."""
        self.stats.inc("rebalances", kind="revoke")
        revoked = {tp.partition for tp in partitions}
        before = self.stats.total("groups_published")
        if self._fatal is None:   # after a fatal error nothing more is published: just let go
            self.publication.offer(self.finalization.drain(self.cfg.revoke_budget_ms / 1000, only=revoked))
            try:
                self._publish(force=True)
            except Rewind as why:
                self._rewind(why)   # the partitions kept start over; the revoked ones go now
        left = sum(s.open_groups for s in self.partitions if s.number in revoked)
        self._let_go(consumer, partitions)
        logger.info("revoked partitions %s: published %d finished groups first, %d open groups left "
                    "to the next owner; now holding %s", sorted(revoked),
                    self.stats.total("groups_published") - before, left, self.partitions.numbers())

    def _on_lost(self, consumer, partitions) -> None:
        """Lost partitions may already be owned by another member: publish nothing for them."""
        self.stats.inc("rebalances", kind="lost")
        self._let_go(consumer, partitions)
        logger.warning("lost partitions %s (session timed out or fenced): their unpublished work is "
                       "dropped, the new owner re-reads it; now holding %s",
                       sorted(tp.partition for tp in partitions), self.partitions.numbers())

    def _let_go(self, consumer, partitions) -> None:
        """Forget the partitions: their state, what every step holds for them, their pause
        flags. Late results of theirs are discarded by epoch."""
        numbers = self.assignment.remove(consumer, partitions)
        self._forget(numbers, dropped=True)
        self.pauses.apply(consumer, self._pause_reasons())
        self._set_gauges()

    # -- what it holds, for readiness, tests and operators ---------------------------------
    @property
    def consumer(self):
        return self.clients.consumer

    @property
    def publisher(self):
        return self.flight.publisher

    @property
    def buffers(self) -> dict:
        """Partition -> its buffer, for the partitions whose ledger has loaded."""
        return {s.number: s.buffer for s in self.partitions.loaded()}

    @property
    def halted(self) -> dict[int, str]:
        """Partition -> why finalization stopped there."""
        return dict(self.finalization.halted)

    def readiness(self) -> tuple[bool, str]:
        unreachable = self.broker_health.describe()
        if unreachable is not None:
            return False, unreachable
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
        return True, (f"{pairs} partitions assigned: {len(self.topics) * pairs} topic-partitions "
                      f"({' and '.join(self.topics)}, as the assigned_partitions gauge counts them)")

    @property
    def ready(self) -> bool:
        return self.readiness()[0]


def _quietly(what: str, close) -> None:
    """A shutdown step whose failure is logged, never raised over the stage's own error."""
    if not close:
        return
    try:
        close()
    except Exception as error:  # noqa: BLE001 - shutdown goes on; the stage's error stays the one reported
        logger.warning("%s: %s: %s", what, type(error).__name__, error)


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
