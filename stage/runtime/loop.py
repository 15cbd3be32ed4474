"""The stage's consumer loop: decode -> buffer -> finalize (worker pool) -> publish + commit.

One consumer in the group subscribes to the receipts topic with cooperative-sticky assignment;
for every receipts partition it is given it also assigns the same partition of the staged-calls
topic (co-partitioning: cooperative-sticky balances topic-partitions independently, so two
subscribed topics would not stay co-assigned). Offsets of both are committed through the same
transaction as the outputs.

The loop never blocks on finalization: groups are finalized in a thread pool with a bounded
number in flight, completed groups are published in batches (one transaction each), and the
consumer keeps polling (pausing partitions when the buffers are full).
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
from stage.decode import DecodeError, InputLimits, receipt_item, staged_item
from stage.publish import (
    AtLeastOncePublisher,
    Batch,
    PublishAborted,
    StageFatal,
    TransactionalPublisher,
)
from stage.routes import RouteDimsCache
from stage.runtime.clients import consumer_config, producer_config
from stage.runtime.config import EXACTLY_ONCE, StageConfig
from stage.runtime.ledger import load_ledger
from stage.runtime.stats import RuntimeStats
from stage.runtime.topics import check_copartitioning
from stage.runtime.worker import Outputs, finalize_and_encode
from stage.wire import AvroCodec, WireError, value_subject

logger = logging.getLogger(__name__)

OUTPUT_RECORDS = ("CanonicalRow", "RoutePlan", "GroupSummary", "LedgerEntry")


def _registry(cfg: StageConfig):
    if cfg.framing != "confluent":
        return None
    from confluent_kafka.schema_registry import SchemaRegistryClient
    return SchemaRegistryClient({"url": cfg.schema_registry_url})


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
        self.buffers: dict[int, PartitionBuffer] = {}
        self.epochs: dict[int, int] = {}          # bumped whenever a partition is (re)assigned
        self.inflight: dict[tuple[int, str], Future] = {}
        self.waiting: list = []                   # (group, why, epoch) taken but not yet submitted
        self.done: list[Outputs] = []             # finalized, waiting for a transaction
        self.dead_letters: list = []              # batch records for the next transaction
        self.tombstones: list = []
        self.paused = False
        self.ready = False
        self._stop = threading.Event()
        self._last_commit = time.monotonic()
        self._offsets_dirty = False
        self.committed: dict[tuple[str, int], int] = {}   # (topic, partition) -> committed offset
        self.consumer: Consumer | None = None
        self.publisher = None
        self.pool = ThreadPoolExecutor(cfg.finalize_workers, thread_name_prefix="finalize")
        # One transaction at a time, off the loop thread: (future, outputs, batch) or None.
        self.publish_pool = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._flight = None
        self.health = None

    # -- lifecycle -------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def start(self) -> None:
        admin = AdminClient({"bootstrap.servers": self.cfg.bootstrap_servers, **self.cfg.kafka})
        self.partitions = check_copartitioning(admin, self.cfg)
        producer = Producer(producer_config(self.cfg))
        self.publisher = (TransactionalPublisher(producer, self.cfg.transaction_timeout_ms / 1000)
                          if self.cfg.processing == EXACTLY_ONCE else AtLeastOncePublisher(producer))
        self.publisher.start()
        consumer_conf = consumer_config(self.cfg)
        if self.cfg.statistics_interval_ms > 0:  # per-partition consumer lag for /metrics
            consumer_conf.setdefault("statistics.interval.ms", self.cfg.statistics_interval_ms)
            consumer_conf["stats_cb"] = self.stats.sink.librdkafka_stats
        self.consumer = Consumer(consumer_conf)
        # The staged-calls topic is assigned by hand (not subscribed): load its metadata now so
        # its partitions start fetching as soon as they are assigned.
        self.consumer.list_topics(self.cfg.topics.staged_calls, timeout=10)
        self.consumer.subscribe([self.cfg.topics.receipts], on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_lost)
        if self.cfg.metrics_port and self.health is None:
            from stage.observability import HealthServer
            self.health = HealthServer(self, self.cfg.metrics_port).start()
            logger.info("metrics and health on :%d (/metrics, /healthz, /readyz)", self.health.port)
        logger.info("stage started: %d partitions, %s, transactional.id=%s", self.partitions,
                    self.cfg.processing, self.cfg.effective_transactional_id)

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
        try:
            self._pause_all(True)
            self._submit()
            self._drain(self.cfg.revoke_budget_ms / 1000)
            self._publish(force=True)
            self.consumer.close()  # leaves the group (the revoke callback publishes nothing new)
        except StageFatal:
            logger.exception("fatal error during shutdown")
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.publish_pool.shutdown(wait=True)
            self.publisher.close()
            self.consumer = None
            if self.health is not None:
                self.health.stop()
                self.health = None

    # -- one iteration ---------------------------------------------------------------------
    def step(self) -> None:
        messages = self.consumer.consume(num_messages=1000, timeout=self.cfg.poll_timeout_ms / 1000)
        now = self.clock.now_ms()
        for msg in messages:
            self._intake(msg, now)
        self._take_ready(now)
        self._submit()
        self._collect()
        self._publish()
        self._backpressure()
        self.stats.set("inflight_groups", len(self.inflight) + len(self.done) + len(self.waiting))
        self.stats.heartbeat()

    def _intake(self, msg, now_ms: int) -> None:
        err = msg.error()
        if err is not None:
            if err.fatal():
                raise StageFatal(f"consumer error: {err}")
            logger.warning("consumer error: %s", err)
            return
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        buffer = self.buffers.get(partition)
        if buffer is None:
            return  # revoked while the message was in flight
        self.stats.inc("records_consumed", topic=topic)
        ts_type, ts = msg.timestamp()
        position = Position(topic, partition, offset, ts if ts_type and ts > 0 else now_ms)
        value = msg.value()
        try:
            if value is None:
                raise DecodeError("record has no value")
            if topic == self.cfg.topics.receipts:
                item = receipt_item(self.codecs["ReceiptEvent"].decode(value), position, len(value), self.limits)
                outcome = buffer.add_receipt(item, now_ms)
            else:
                item = staged_item(self.codecs["StagedCall"].decode(value), position, len(value), self.limits)
                outcome = buffer.add_staged(item, now_ms)
        except (WireError, DecodeError, ValueError, KeyError, TypeError) as error:
            self._dead_letter(msg, error)
            buffer.skip(topic, offset, position.timestamp_ms)
            return
        if outcome == CONFLICT:  # well-formed but contradicts its group: keep it, visibly
            self._dead_letter(msg, DecodeError(
                f"conflicts with group {item.group_id}: group_size {item.group_size}, "
                f"rollout_index {getattr(item, 'rollout_index', '-')}"))
        if outcome != ADDED:
            self.stats.inc("records_skipped", topic=topic, reason=outcome)
            self._offsets_dirty = True

    def _dead_letter(self, msg, error: Exception) -> None:
        headers = list(msg.headers() or []) + [
            ("source-topic", msg.topic().encode()), ("source-partition", str(msg.partition()).encode()),
            ("source-offset", str(msg.offset()).encode()),
            ("error", f"{type(error).__name__}: {error}"[:4000].encode("utf-8", "replace"))]
        self.dead_letters.append((self.cfg.topics.dead_letter, None, msg.key(), msg.value() or b"", headers))
        self.stats.inc("dead_letters", topic=msg.topic())
        logger.warning("dead-lettered %s[%d]@%d: %s", msg.topic(), msg.partition(), msg.offset(), error)

    def _caught_up(self) -> dict[int, dict[str, bool]]:
        """Per partition and input topic: is the consumer at the end of it (local state only)?"""
        topics = (self.cfg.topics.receipts, self.cfg.topics.staged_calls)
        tps = [TopicPartition(t, p) for p in self.buffers for t in topics]
        out: dict[int, dict[str, bool]] = {p: {} for p in self.buffers}
        if not tps:
            return out
        for tp in self.consumer.position(tps):
            try:
                _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            except KafkaException:
                high = -1
            out[tp.partition][tp.topic] = high >= 0 and tp.offset >= high if tp.offset >= 0 else high == 0
        return out

    def _take_ready(self, now_ms: int) -> None:
        caught_up = self._caught_up()
        for partition, buffer in self.buffers.items():
            ready, orphans = buffer.take_ready(now_ms, caught_up.get(partition))
            for group, why in ready:
                self.waiting.append((group, why, self.epochs[partition]))
                self.stats.observe("group_fill_seconds", max(0.0, (now_ms - group.first_timestamp_ms) / 1000))
            if orphans:
                self.stats.inc("orphan_groups_expired", len(orphans))
                self.stats.inc("orphan_staged_expired", sum(len(g.staged) for g in orphans))
                self._offsets_dirty = True

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
                outputs = future.result()  # finalize_and_encode never raises for a group
                if self.epochs.get(outputs.partition) == outputs.epoch:
                    self.done.append(outputs)
                    self.stats.observe("finalize_seconds", outputs.finalize_s)

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
        batch.records.extend(self.dead_letters)
        batch.records.extend(self.tombstones)
        self.dead_letters, self.tombstones = [], []
        batch.offsets = self._committable({(o.partition, o.group_id) for o in outputs})
        batch.group_metadata = self.consumer.consumer_group_metadata()
        self._offsets_dirty = False
        if not batch:
            return None
        return outputs, batch

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

    def _committable(self, publishing: set) -> list[TopicPartition]:
        """Per input partition, the lowest offset still needed once this batch is published."""
        offsets = []
        for partition, buffer in self.buffers.items():
            excluding = {group_id for p, group_id in publishing if p == partition}
            for topic in (self.cfg.topics.receipts, self.cfg.topics.staged_calls):
                committed = self.committed.get((topic, partition))
                candidate = buffer.committable(topic, committed, excluding=excluding)
                if candidate is not None and candidate != committed:
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
        ledger_codec = self.codecs["LedgerEntry"]
        staged = [TopicPartition(self.cfg.topics.staged_calls, tp.partition) for tp in partitions]
        for tp in partitions:
            self._fresh_buffer(tp.partition, ledger_codec)
        # No committed() lookup here: after a member died inside a transaction the broker
        # answers UNSTABLE_OFFSET_COMMIT until that transaction times out, and librdkafka's
        # own fetch of the start offsets already waits for it (KIP-447). self.committed fills
        # in with our own commits; the buffer never proposes an offset below its first record.
        consumer.incremental_assign(list(partitions) + staged)
        self.stats.set("assigned_partitions", 2 * len(self.buffers))
        self.ready = True
        logger.info("assigned partitions %s", sorted(tp.partition for tp in partitions))

    def _fresh_buffer(self, partition: int, ledger_codec) -> None:
        buffer = PartitionBuffer(partition, receipts_topic=self.cfg.topics.receipts,
                                 staged_topic=self.cfg.topics.staged_calls,
                                 group_timeout_ms=self.cfg.group_timeout_ms,
                                 late_retention_ms=self.cfg.late_retention_ms)
        for group_id, entry in load_ledger(self.cfg, ledger_codec, partition).items():
            buffer.load_published(group_id, {self.cfg.topics.receipts: entry["max_receipt_offset"],
                                             self.cfg.topics.staged_calls: entry["max_staged_offset"]},
                                  entry["published_at_ms"])
        self.buffers[partition] = buffer
        self.epochs[partition] = self.epochs.get(partition, 0) + 1

    def _on_revoke(self, consumer, partitions) -> None:
        """Cooperative revoke: publish what is finished for these partitions within the budget
        (the new owner re-reads the rest from the committed offsets), then let them go."""
        self.stats.inc("rebalances", kind="revoke")
        revoked = {tp.partition for tp in partitions}
        self._drain(self.cfg.revoke_budget_ms / 1000, only=revoked)
        try:
            self._publish(force=True)
        except StageFatal:
            raise
        self._drop(revoked)
        consumer.incremental_unassign(list(partitions) + [
            TopicPartition(self.cfg.topics.staged_calls, p) for p in revoked])

    def _on_lost(self, consumer, partitions) -> None:
        """Lost partitions may already be owned by another member: publish nothing for them."""
        self.stats.inc("rebalances", kind="lost")
        lost = {tp.partition for tp in partitions}
        self._drop(lost)
        consumer.incremental_unassign(list(partitions) + [
            TopicPartition(self.cfg.topics.staged_calls, p) for p in lost])

    def _drop(self, partitions: set[int]) -> None:
        self.stats.set("assigned_partitions", 2 * len(set(self.buffers) - set(partitions)))
        for p in partitions:
            self.buffers.pop(p, None)
            self.epochs[p] = self.epochs.get(p, 0) + 1   # late results of this epoch are ignored
            for key in [k for k in self.committed if k[1] == p]:
                del self.committed[key]
        self.done = [o for o in self.done if o.partition not in partitions]
        self.waiting = [w for w in self.waiting if w[0].partition not in partitions]
        self.tombstones = [t for t in self.tombstones if t[1] not in partitions]
        self.ready = bool(self.buffers)

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
        partitions = sorted(self.buffers)
        self.done.clear()
        self.waiting.clear()
        self.dead_letters.clear()
        self.tombstones.clear()
        ledger_codec = self.codecs["LedgerEntry"]
        tps = [TopicPartition(t, p) for p in partitions
               for t in (self.cfg.topics.receipts, self.cfg.topics.staged_calls)]
        committed = self._committed_offsets(tps) if tps else []
        for p in partitions:
            self._fresh_buffer(p, ledger_codec)
        for tp in committed:
            if tp.offset < 0:
                low, _ = self.consumer.get_watermark_offsets(tp, timeout=10)
                tp = TopicPartition(tp.topic, tp.partition, low)
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

    # -- back-pressure ---------------------------------------------------------------------
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
        if full and not stuck and not self.paused:
            self._pause_all(True)
        elif self.paused and (drained or stuck):
            self._pause_all(False)

    def _pause_all(self, pause: bool) -> None:
        assignment = self.consumer.assignment()
        if not assignment:
            self.paused = pause
            return
        (self.consumer.pause if pause else self.consumer.resume)(assignment)
        self.paused = pause
        self.stats.set("paused_partitions", len(assignment) if pause else 0)
