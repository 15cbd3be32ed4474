"""Partitions coming and going: ledger loads (off the loop, the partition paused until done),
cooperative assign/revoke/lost, rewind after an abort, back-pressure and the topology watch.
Part of StageRuntime (stage.runtime.loop)."""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaException, TopicPartition

from stage.buffer import PartitionBuffer
from stage.runtime import exits
from stage.runtime.ledger import LoadCancelled, load_ledger
from stage.runtime.pauses import BACKPRESSURE, HALTED, LOADING

logger = logging.getLogger("stage.runtime.loop")


class AssignmentSteps:
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
        if self._fatal is None:   # after a fatal error nothing more is published: just let go
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



def _repartitioned(topic: str, expected: int, found: int) -> exits.StageExit:
    return exits.StageExit(exits.EXIT_TOPOLOGY, (
        f"topic {topic} now has {found} partitions, not {expected}: partitions were added while "
        "the stage was running. Group ids map to partitions by their count, so receipts and "
        "staged calls of one group would now land in different partitions and never meet. The "
        "stage stopped without committing past unpublished groups. Stop the producers, let the "
        "stage drain the old layout, then give every co-partitioned topic the same new count "
        "(`rollout-reassembler topics check` shows the layout) before restarting."))
