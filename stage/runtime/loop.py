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

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.buffer import ADDED, CONFLICT, PartitionBuffer, Position, SystemClock
from stage.decode import DecodeError, InputLimits, MisroutedError, check_routing, receipt_item, staged_item
from stage.publish import (
    AtLeastOncePublisher,
    Batch,
    PublishAborted,
    StageFatal,
    TransactionalPublisher,
)
from stage.publish.deadletters import (
    CONFLICT as CONFLICT_CLASS,
)
from stage.publish.deadletters import (
    DEAD_LETTER_WATERMARK_KEY,
    DEAD_LETTERED_BEFORE,
    INVALID,
    MISROUTED,
    UNDECODABLE,
    DeadLetter,
    watermark_entry,
)
from stage.routes import RouteDimsCache
from stage.runtime import exits
from stage.runtime.availability import EndOffsetProbe, StartOffsets
from stage.runtime.clients import consumer_config, producer_config
from stage.runtime.config import EXACTLY_ONCE, StageConfig
from stage.runtime.ledger import LoadCancelled, load_ledger
from stage.runtime.pauses import BACKPRESSURE, HALTED, LOADING, REGISTRY, SHUTDOWN, PauseSet
from stage.runtime.registry import SchemaResolver
from stage.runtime.startup import connect_admin, probe_device, register_output_schemas
from stage.runtime.stats import RuntimeStats
from stage.runtime.probes import BrokerQueries
from stage.runtime.topics import PartitionWatch
from stage.runtime.worker import Outputs, finalize_and_encode
from stage.wire import AvroCodec, SchemaNotCached, WireError, value_subject

logger = logging.getLogger(__name__)

OUTPUT_RECORDS = ("CanonicalRow", "RoutePlan", "GroupSummary", "LedgerEntry")
_NOT_FETCHING = frozenset({LOADING, REGISTRY, HALTED})   # a partition held for these is not "read"
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


class StageRuntime:
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
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.loader_pool.shutdown(wait=False, cancel_futures=True)
            self.publish_pool.shutdown(wait=True)
            if self.resolver is not None:
                self.resolver.close()
            if self.queries is not None:
                self.queries.close()
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

    # -- intake ----------------------------------------------------------------------------
    def _intake(self, msg, now_ms: int) -> None:
        err = msg.error()
        if err is not None:
            if err.fatal():
                raise exits.kafka_fatal(f"consumer: {err}")
            logger.warning("consumer error: %s", err)
            return
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        if (topic, partition) in self._blocked:
            return  # after a record of this partition was put back: re-fetched from there
        if partition in self.loading:
            self._put_back(msg)
            return
        buffer = self.buffers.get(partition)
        if buffer is None:
            return  # revoked while the message was in flight
        ts_type, ts = msg.timestamp()
        position = Position(topic, partition, offset, ts if ts_type and ts > 0 else now_ms)
        value = msg.value()
        receipts = topic == self.cfg.topics.receipts
        codec = self.codecs["ReceiptEvent" if receipts else "StagedCall"]
        try:
            if value is None:
                raise DecodeError("the record has no value (a tombstone); input records carry one")
            record = codec.decode(value, fetch=False)
            make = receipt_item if receipts else staged_item
            item = make(record, position, len(value), self.limits)
            check_routing(msg.key(), item.group_id, partition, self.partitions)
        except SchemaNotCached as pending:   # not consumed: read again once the id is resolved
            self._put_back(msg)
            self.pauses.hold(partition, REGISTRY)
            self.resolver.request(codec, pending.schema_id, partition)
            return
        except MisroutedError as error:
            self._reject(msg, buffer, position, error, MISROUTED)
            return
        except WireError as error:
            self._reject(msg, buffer, position, error, UNDECODABLE)
            return
        except (DecodeError, ValueError, KeyError, TypeError) as error:
            self._reject(msg, buffer, position, error,
                         UNDECODABLE if value is None else INVALID)
            return
        self.stats.inc("records_consumed", topic=topic)
        outcome = buffer.add_receipt(item, now_ms) if receipts else buffer.add_staged(item, now_ms)
        if outcome == CONFLICT:  # well-formed but contradicts its group: keep it, visibly
            self._reject(msg, None, position, DecodeError(buffer.last_conflict), CONFLICT_CLASS)
        if outcome != ADDED:
            self.stats.inc("records_skipped", topic=topic, reason=outcome)
            self._offsets_dirty = True

    def _put_back(self, msg) -> None:
        """Unread ``msg`` (and the rest of its partition in this batch): fetched again later."""
        tp = TopicPartition(msg.topic(), msg.partition(), msg.offset())
        self._blocked.add((tp.topic, tp.partition))
        if self.probe is not None:
            self.probe.invalidate(tp.topic, tp.partition)
        try:
            self.consumer.seek(tp)
        except KafkaException as error:  # not expected for an assigned partition: start over
            logger.error("seek %s[%d] to %d failed (%s); rewinding to the committed offsets",
                         tp.topic, tp.partition, tp.offset, error)
            self._rewind()

    def _reject(self, msg, buffer, position: Position, error: Exception, error_class: str) -> None:
        """Dead-letter a record once: after a restart, records at or below the partition's
        dead-letter watermark (from the ledger) were dead-lettered already."""
        topic, partition, offset = position.topic, position.partition, position.offset
        if buffer is not None:   # (a conflict was counted when the buffer took it)
            self.stats.inc("records_consumed", topic=topic)
        if buffer is not None:
            buffer.skip(topic, offset, position.timestamp_ms)
        watermarks = self.dl_watermarks.setdefault(partition, {})
        if offset <= watermarks.get(topic, -1):
            self.stats.inc("records_skipped", topic=topic, reason=DEAD_LETTERED_BEFORE)
            self._offsets_dirty = True
            return
        watermarks[topic] = offset
        text = f"{type(error).__name__}: {error}"
        self.dead_letters.append(DeadLetter(topic, partition, offset, msg.key(), msg.value(),
                                            list(msg.headers() or []), text, error_class))
        self.stats.inc("dead_letters", topic=topic, reason=error_class)
        logger.warning("dead-lettered %s[%d]@%d (%s): %s", topic, partition, offset, error_class, error)

    # -- ledger loading --------------------------------------------------------------------
    def _start_loading(self, partition: int, delay_s: float = 0.0) -> None:
        self.epochs[partition] = epoch = self.epochs.get(partition, 0) + 1
        self.buffers.pop(partition, None)
        self.pauses.hold(partition, LOADING)
        if self.start_offsets is not None:
            for topic in self.topics:
                self.start_offsets.forget(topic, partition)

        def stopped() -> bool:
            return self._stop.is_set() or self.epochs.get(partition) != epoch

        def load():
            if delay_s and self._stop.wait(delay_s):
                raise LoadCancelled()
            return load_ledger(self.cfg, self.codecs["LedgerEntry"], partition, should_stop=stopped)

        self.loading[partition] = (self.loader_pool.submit(load), epoch)

    def _finish_loads(self) -> None:
        for partition, (future, epoch) in list(self.loading.items()):
            if not future.done():
                continue
            del self.loading[partition]
            if self.epochs.get(partition) != epoch:
                continue
            try:
                state = future.result()
            except LoadCancelled:
                continue
            except Exception as error:  # noqa: BLE001 - broker trouble: keep the partition paused, retry
                logger.warning("loading the ledger of partition %d failed (%s: %s); retrying in 2s",
                               partition, type(error).__name__, error)
                self._start_loading(partition, delay_s=2.0)
                continue
            buffer = PartitionBuffer(partition, receipts_topic=self.cfg.topics.receipts,
                                     staged_topic=self.cfg.topics.staged_calls,
                                     group_timeout_ms=self.cfg.group_timeout_ms,
                                     late_retention_ms=self.cfg.late_retention_ms)
            for group_id, entry in state.groups.items():
                buffer.load_published(group_id, {self.cfg.topics.receipts: entry["max_receipt_offset"],
                                                 self.cfg.topics.staged_calls: entry["max_staged_offset"]},
                                      entry["published_at_ms"])
            self.buffers[partition] = buffer
            self.dl_watermarks[partition] = {
                self.cfg.topics.receipts: state.dead_letter_offsets.get("receipts", -1),
                self.cfg.topics.staged_calls: state.dead_letter_offsets.get("staged_calls", -1)}
            self.pauses.release(partition, LOADING)
            logger.info("partition %d ready: %d published groups in its ledger, dead letters up to "
                        "offsets %s", partition, len(state.groups), state.dead_letter_offsets or "none")

    # -- schema registry -------------------------------------------------------------------
    def _resolve_schemas(self) -> None:
        if self.resolver is None:
            return
        for partition in self.resolver.poll():
            self.pauses.release(partition, REGISTRY)

    # -- readiness and deadlines -----------------------------------------------------------
    def _take_ready(self, now_ms: int) -> None:
        due = {}
        for partition, buffer in self.buffers.items():
            deadline = buffer.next_deadline_ms()
            if partition not in self.halted and deadline is not None and deadline <= now_ms:
                due[partition] = deadline
        self.probe.poll(urgent={(t, p): d for p, d in due.items() for t in self.topics})
        positions = self._positions(due) if due else {}
        held = {}
        for partition, buffer in self.buffers.items():
            if partition in self.halted:
                continue
            read_to_end, force_before = {}, None
            if partition in due:
                not_fetching = self.pauses.why(partition) & _NOT_FETCHING
                for topic in self.topics:
                    read_to_end[topic] = -1 if not_fetching else self.probe.note_position(
                        topic, partition, positions.get((topic, partition), -1))
                unavailable = [t for t in self.topics if not self.probe.available(t, partition)]
                if unavailable and not not_fetching:
                    held[partition] = ", ".join(
                        f"{t}[{partition}] ({self.probe.why_unavailable(t, partition)})"
                        for t in unavailable)
                    if now_ms - due[partition] >= self.cfg.deadline_hold_max_ms:
                        force_before = now_ms - self.cfg.deadline_hold_max_ms
            ready, orphans = buffer.take_ready(now_ms, read_to_end, force_before_ms=force_before)
            if force_before is not None and (ready or orphans):
                self.stats.inc("deadlines_forced", len(ready) + len(orphans))
                logger.warning("partition %d: %d deadlines fired after waiting %.0fs for an unavailable "
                               "input partition (%s)", partition, len(ready) + len(orphans),
                               self.cfg.deadline_hold_max_ms / 1000, held.get(partition))
            for group, why in ready:
                self.waiting.append((group, why, self.epochs[partition]))
                self.stats.observe("group_fill_seconds", max(0.0, (now_ms - group.first_timestamp_ms) / 1000))
            if orphans:
                self.stats.inc("orphan_groups_expired", len(orphans))
                self.stats.inc("orphan_staged_expired", sum(len(g.staged) for g in orphans))
                self._offsets_dirty = True
        for partition in set(held) - set(self.held):
            logger.warning("deadlines of partition %d wait: input %s unavailable; they fire when it "
                           "answers again, or after deadline_hold_max_ms=%d", partition, held[partition],
                           self.cfg.deadline_hold_max_ms)
        for partition in set(self.held) - set(held):
            logger.info("deadlines of partition %d no longer wait for an unavailable input", partition)
        self.held = held
        self.stats.set("deadline_held_partitions", len(held))

    def _positions(self, partitions) -> dict[tuple[str, int], int]:
        """Where the consumer is in each input partition. Before the first record of an
        assignment librdkafka reports no position: the fetch started at the committed offset
        (or at the log start when none is committed)."""
        tps = [TopicPartition(t, p) for p in partitions for t in self.topics]
        out = {}
        for tp in self.consumer.position(tps):
            key = (tp.topic, tp.partition)
            out[key] = tp.offset if tp.offset >= 0 else self._start_offset(tp)
        return out

    def _start_offset(self, tp: TopicPartition) -> int:
        return self.start_offsets.get(tp.topic, tp.partition, time.monotonic())

    def _submit(self) -> None:
        while self.waiting and len(self.inflight) + len(self.done) < self.cfg.max_inflight_groups:
            group, why, epoch = self.waiting.pop(0)
            future = self.pool.submit(
                finalize_and_encode, group, why, epoch, config=self.cfg.finalize,
                dims_cache=self.dims_cache, codecs=self.codecs, topics=self.cfg.topics,
                limits=self.limits, now_ms=self.clock.now_ms)
            self.inflight[(group.partition, group.group_id)] = future

    def _collect(self) -> None:
        """Move finished finalizations to ``done`` (dropping results of revoked partitions)."""
        for key, future in list(self.inflight.items()):
            if future.done():
                del self.inflight[key]
                outputs = future.result()  # finalize_and_encode never raises
                if self.epochs.get(outputs.partition) != outputs.epoch:
                    continue
                if outputs.error is not None:
                    self._halt(outputs)
                    continue
                self.done.append(outputs)
                self.stats.observe("finalize_seconds", outputs.finalize_s)

    def _halt(self, out: Outputs) -> None:
        """A group failed in finalization for a reason that fails every group (device, route
        dims, encoding): stop this partition here. The group stays unpublished and holds the
        committed offset, so a restart (after the cause is fixed) finalizes it again."""
        self.stats.inc("finalize_errors")
        if out.partition not in self.halted:
            self.halted[out.partition] = f"group {out.group_id}: {out.error}"
            logger.error("partition %d halted: group %s failed in finalization (%s). Nothing past it "
                         "is committed; fix the cause and restart the stage. Other partitions go on.",
                         out.partition, out.group_id, out.error)
        self.pauses.hold(out.partition, HALTED)
        self.waiting = [w for w in self.waiting if w[0].partition != out.partition]
        self.stats.set("halted_partitions", len(self.halted))

    # -- publication -----------------------------------------------------------------------
    def _publish(self, force: bool = False) -> None:
        """Keep one transaction in flight on the publisher thread while the loop goes on
        consuming and finalizing; apply its outcome when it completes. ``force``: publish
        everything finished now and wait (shutdown, revoke)."""
        if self._flight is not None:
            if not (force or self._flight[0].done()):
                return
            self._land(*self._flight)
        while True:
            batch = self._next_batch(force)
            if batch is None:
                return
            future = self.publish_pool.submit(self._timed_publish, batch[1])
            self._flight = (future, *batch)
            if not force:
                return
            self._land(*self._flight)
            if not self.done and not self.dead_letters and not self.tombstones:
                return

    def _next_batch(self, force: bool):
        oldest = min((o.ready_at for o in self.done), default=None)
        due = (force or len(self.done) >= self.cfg.publish_batch_groups or self.dead_letters
               or (oldest is not None and time.monotonic() - oldest >= self.cfg.publish_linger_ms / 1000)
               or (self._offsets_dirty and time.monotonic() - self._last_commit >= 1.0))
        if not due:
            return None
        outputs = self.done[:self.cfg.publish_batch_groups]
        del self.done[:len(outputs)]
        batch = Batch()
        for out in outputs:
            key = out.group_id.encode("utf-8")
            for topic, value in out.records:
                batch.records.append((topic, out.partition, key, value, None))
            batch.records.append((self.cfg.topics.stage_ledger, out.partition, key, out.ledger_value, None))
        batch.records.extend(dl.record(self.cfg.topics.dead_letter) for dl in self.dead_letters)
        batch.records.extend(self._watermark_records({dl.source_partition for dl in self.dead_letters}))
        batch.records.extend(self.tombstones)
        self.dead_letters, self.tombstones = [], []
        batch.offsets = self._committable({(o.partition, o.group_id) for o in outputs})
        batch.group_metadata = self.consumer.consumer_group_metadata()
        self._offsets_dirty = False
        if not batch:
            return None
        return outputs, batch

    def _watermark_records(self, partitions) -> list:
        """The ledger entry that makes this transaction's dead letters exactly once."""
        codec, now = self.codecs["LedgerEntry"], self.clock.now_ms()
        out = []
        for p in sorted(partitions):
            marks = self.dl_watermarks.get(p, {})
            entry = watermark_entry(p, marks.get(self.cfg.topics.receipts, -1),
                                    marks.get(self.cfg.topics.staged_calls, -1), now)
            out.append((self.cfg.topics.stage_ledger, p, DEAD_LETTER_WATERMARK_KEY, codec.encode(entry), None))
        return out

    def _timed_publish(self, batch: Batch) -> float:
        started = time.monotonic()
        self.publisher.publish(batch, self.consumer)
        return time.monotonic() - started

    def _land(self, future, outputs, batch) -> None:
        """Apply a finished publication: mark its groups published, or rewind after an abort."""
        self._flight = None
        try:
            seconds = future.result()
            self.publisher.commit_offsets(batch, self.consumer)  # at-least-once only
        except PublishAborted as error:
            logger.warning("publication aborted (%s); rewinding to the committed offsets", error)
            self.stats.inc("transactions_aborted")
            self._rewind()
            return
        except StageFatal as error:
            text = str(error)
            if "fenced" in text.lower():
                raise exits.fenced(self.cfg.effective_transactional_id, text) from None
            raise exits.kafka_fatal(text) from None
        self.stats.inc("transactions_committed")
        self.stats.observe("publish_seconds", seconds)
        now = self.clock.now_ms()
        for out in outputs:
            buffer = self.buffers.get(out.partition)
            if buffer is not None and out.group_id in buffer.groups:
                buffer.mark_published(out.group_id, now)
            self.stats.inc("groups_published", outcome=out.outcome)
            self.stats.inc("rows_published", out.valid_rows, valid="true")
            self.stats.inc("rows_published", out.total_rows - out.valid_rows, valid="false")
            for reason in out.rejections:
                self.stats.inc("rejections", bucket=(reason or "unknown").split(":", 1)[0])
            self.stats.sink.group_metrics_observed(out.metrics)
            self.stats.observe("end_to_end_seconds",
                               max(0.0, (now - out.context.last_timestamp_ms) / 1000))
        self._remember_committed(batch.offsets)
        self._last_commit = time.monotonic()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("committed: groups %s, %d records, offsets %s", [o.group_id for o in outputs],
                         len(batch.records), {f"{tp.topic}[{tp.partition}]": tp.offset for tp in batch.offsets})

    def _committable(self, publishing: set) -> list[TopicPartition]:
        """Per input partition, the lowest offset still needed once this batch is published.
        Every known offset is sent, changed or not: the offset commit is what fences a replica
        that stalled past its session timeout (KIP-447 checks the group generation there), so
        no transaction may go without one."""
        offsets = []
        for partition, buffer in self.buffers.items():
            excluding = {group_id for p, group_id in publishing if p == partition}
            for topic in self.topics:
                committed = self.committed.get((topic, partition))
                candidate = buffer.committable(topic, committed, excluding=excluding)
                if candidate is not None:
                    offsets.append(TopicPartition(topic, partition, candidate))
        return offsets

    def _remember_committed(self, offsets: list[TopicPartition]) -> None:
        for tp in offsets:
            self.committed[(tp.topic, tp.partition)] = tp.offset
        now = self.clock.now_ms()
        for partition, buffer in self.buffers.items():
            committed = {topic: off for (topic, p), off in self.committed.items() if p == partition}
            for group_id in buffer.expire_published(committed, now):
                self.tombstones.append((self.cfg.topics.stage_ledger, partition,
                                        group_id.encode("utf-8"), None, None))

    # -- rebalance -------------------------------------------------------------------------
    def _on_assign(self, consumer, partitions) -> None:
        self.stats.inc("rebalances", kind="assign")
        new = sorted(tp.partition for tp in partitions)
        beyond = [p for p in new if p >= self.partitions]
        if beyond and self._fatal is None:
            self._fatal = _repartitioned(self.cfg.topics.receipts, self.partitions, max(beyond) + 1)
        for p in new:
            self._start_loading(p)
        staged = [TopicPartition(self.cfg.topics.staged_calls, p) for p in new]
        consumer.incremental_assign(list(partitions) + staged)
        self.pauses.apply(consumer, self._assigned())  # loading partitions fetch nothing yet
        self.probe.track([(t, p) for p in self._assigned() for t in self.topics])
        self.stats.set("assigned_partitions", 2 * len(self._assigned()))
        logger.info("assigned partitions %s (now holding %s); loading their ledgers", new, self._assigned())

    def _on_revoke(self, consumer, partitions) -> None:
        """Cooperative revoke: publish what is finished for these partitions within the budget
        (the new owner re-reads the rest from the committed offsets), then let them go."""
        self.stats.inc("rebalances", kind="revoke")
        revoked = {tp.partition for tp in partitions}
        before = self.stats.total("groups_published")
        self._drain(self.cfg.revoke_budget_ms / 1000, only=revoked)
        self._publish(force=True)
        left = sum(self.buffers[p].open_groups for p in revoked if p in self.buffers)
        self._drop(revoked)
        consumer.incremental_unassign(list(partitions) + [
            TopicPartition(self.cfg.topics.staged_calls, p) for p in revoked])
        logger.info("revoked partitions %s: published %d finished groups first, %d open groups left "
                    "to the next owner; now holding %s", sorted(revoked),
                    self.stats.total("groups_published") - before, left, self._assigned())

    def _on_lost(self, consumer, partitions) -> None:
        """Lost partitions may already be owned by another member: publish nothing for them."""
        self.stats.inc("rebalances", kind="lost")
        lost = {tp.partition for tp in partitions}
        self._drop(lost)
        consumer.incremental_unassign(list(partitions) + [
            TopicPartition(self.cfg.topics.staged_calls, p) for p in lost])
        logger.warning("lost partitions %s (session timed out or fenced): their unpublished work is "
                       "dropped, the new owner re-reads it; now holding %s", sorted(lost), self._assigned())

    def _drop(self, partitions: set[int]) -> None:
        for p in partitions:
            self.buffers.pop(p, None)
            self.loading.pop(p, None)
            self.halted.pop(p, None)
            self.held.pop(p, None)
            self.dl_watermarks.pop(p, None)
            self.epochs[p] = self.epochs.get(p, 0) + 1   # late results of this epoch are ignored
            for key in [k for k in self.committed if k[1] == p]:
                del self.committed[key]
        self.pauses.forget(partitions)
        if self.resolver is not None:
            self.resolver.forget(partitions)
        self.done = [o for o in self.done if o.partition not in partitions]
        self.waiting = [w for w in self.waiting if w[0].partition not in partitions]
        self.tombstones = [t for t in self.tombstones if t[1] not in partitions]
        self.dead_letters = [d for d in self.dead_letters if d.source_partition not in partitions]
        if self.probe is not None:
            self.probe.track([(t, p) for p in self._assigned() for t in self.topics])
        self.stats.set("assigned_partitions", 2 * len(self._assigned()))
        self.stats.set("halted_partitions", len(self.halted))

    def _drain(self, budget_s: float, only: set[int] | None = None) -> None:
        """Wait (bounded) for in-flight finalizations, optionally of some partitions only."""
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            pending = [k for k in self.inflight if only is None or k[0] in only]
            if not pending:
                break
            time.sleep(0.01)
            self._collect()
        self._collect()

    def _rewind(self) -> None:
        """After an aborted transaction: forget all derived state and re-read from the committed
        offsets of every assigned partition (the ledger is reloaded too)."""
        partitions = self._assigned()
        self.done.clear()
        self.waiting.clear()
        self.dead_letters.clear()
        self.tombstones.clear()
        self.halted.clear()
        tps = [TopicPartition(t, p) for p in partitions for t in self.topics]
        committed = self._committed_offsets(tps) if tps else []
        for p in partitions:
            self.pauses.release(p, HALTED)
            self._start_loading(p)
        self.pauses.apply(self.consumer, partitions)
        for tp in committed:
            if tp.offset < 0:
                low, _ = self.consumer.get_watermark_offsets(tp, timeout=10)
                tp = TopicPartition(tp.topic, tp.partition, low)
            self.probe.invalidate(tp.topic, tp.partition)
            try:
                self.consumer.seek(tp)
            except KafkaException as e:
                logger.warning("seek %s[%d] to %d failed: %s", tp.topic, tp.partition, tp.offset, e)

    def _committed_offsets(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        """committed(), retried while the broker reports offsets held by an open transaction
        (a dead producer's transaction stays open until transaction.timeout.ms)."""
        deadline = time.monotonic() + self.cfg.transaction_timeout_ms / 1000 + 15
        while True:
            try:
                return self.consumer.committed(tps, timeout=10)
            except KafkaException as e:
                if time.monotonic() > deadline:
                    raise
                logger.warning("committed offsets not available yet (%s); retrying", e.args[0])
                time.sleep(0.5)

    # -- back-pressure and topology --------------------------------------------------------
    def _backpressure(self) -> None:
        nbytes = sum(b.nbytes for b in self.buffers.values())
        groups = sum(b.open_groups for b in self.buffers.values())
        self.stats.set("buffered_bytes", nbytes)
        self.stats.set("open_groups", groups)
        full = nbytes >= self.cfg.max_buffered_bytes or groups >= self.cfg.max_buffered_groups
        drained = (nbytes < self.cfg.resume_fraction * self.cfg.max_buffered_bytes
                   and groups < self.cfg.resume_fraction * self.cfg.max_buffered_groups)
        # Never pause a buffer that can only progress with more input: when no group is being
        # finalized or published, every buffered group waits for records still unread, and a
        # paused consumer would wait for them forever (deadlines, too, wait until the input has
        # been read past them). The caps bound the buffer while groups complete.
        stuck = not (self.inflight or self.waiting or self.done or self._flight)
        if full and not stuck and not self._bp_paused:
            for p in self._assigned():
                self.pauses.hold(p, BACKPRESSURE)
            self._bp_paused = True
        elif self._bp_paused and (drained or stuck):
            self.pauses.release_everywhere(BACKPRESSURE)
            self._bp_paused = False

    def _check_topology(self) -> None:
        if self._topology is None or self._fatal is not None:
            return
        changed = self._topology.poll()
        if changed:
            topic, count = changed
            self._fatal = _repartitioned(topic, self.partitions, count)

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


def _repartitioned(topic: str, expected: int, found: int) -> exits.StageExit:
    return exits.StageExit(exits.EXIT_TOPOLOGY, (
        f"topic {topic} now has {found} partitions, not {expected}: partitions were added while "
        "the stage was running. Group ids map to partitions by their count, so receipts and "
        "staged calls of one group would now land in different partitions and never meet. The "
        "stage stopped without committing past unpublished groups. Stop the producers, let the "
        "stage drain the old layout, then give every co-partitioned topic the same new count "
        "(`rollout-reassembler topics check` shows the layout) before restarting."))


__all__ = ["StageRuntime", "build_codecs", "OUTPUT_RECORDS"]
