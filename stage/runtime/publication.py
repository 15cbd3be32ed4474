"""The loop's finalize and publish steps: ready groups -> the finalize pool -> one transaction
at a time on the publisher thread, with the dead letters, the ledger entries and the input
offsets; a group that fails in finalization halts its partition. Part of StageRuntime
(stage.runtime.loop)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import wait

from confluent_kafka import TopicPartition

from stage.publish import Batch, PublishAborted, StageFatal
from stage.publish.deadletters import DEAD_LETTER_WATERMARK_KEY, watermark_entry
from stage.runtime import exits
from stage.runtime.pauses import HALTED
from stage.runtime.worker import Outputs, finalize_and_encode

logger = logging.getLogger("stage.runtime.loop")

# Kafka's transaction.abort.timed.out.transaction.cleanup.interval.ms (10 s) and a margin.
_ABORT_SWEEP_S = 15.0


class PublicationSteps:
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
                self._check_stall()
                return
            self._land(*self._flight)
        while True:
            batch = self._next_batch(force)
            if batch is None:
                return
            future = self.publish_pool.submit(self._timed_publish, batch[1])
            self._flight = (future, *batch)
            self._flight_started = time.monotonic()
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

    def _stall_deadline(self) -> float:
        """Past the transaction timeout (plus the brokers' abort sweep) a publication can no
        longer commit: the brokers abort it. A call still running then is stuck, not slow."""
        return self._flight_started + self.cfg.transaction_timeout_ms / 1000 + _ABORT_SWEEP_S

    def _check_stall(self) -> None:
        if time.monotonic() > self._stall_deadline():
            self._stalled()

    def _stalled(self) -> None:
        age = time.monotonic() - self._flight_started
        logger.error("publication stuck for %.0fs in the Kafka client; stopping", age)
        self._fatal = exits.publish_stalled(age, self.cfg.effective_transactional_id)
        raise self._fatal

    def _land(self, future, outputs, batch) -> None:
        """Apply a finished publication: mark its groups published, or rewind after an abort."""
        if not wait([future], timeout=max(0.0, self._stall_deadline() - time.monotonic())).done:
            self._stalled()
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
