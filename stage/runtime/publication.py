"""The publish step: finalized outputs, dead letters and ledger tombstones -> one transaction
at a time on the publisher thread, with a ledger entry per group and the input offsets it
covers.

A publication stuck in a coordinator call (librdkafka #5511: send_offsets_to_transaction waits
forever on a coordinator whose broker restarted) is recovered in process: once the call has
not returned in ``publish_stuck_ms``, a new producer with the same transactional.id is started
on its own thread; its init_transactions fences the stuck producer and aborts (or completes)
its transaction, and the stage rewinds to the committed offsets as after any abort. The stuck
call is left on its abandoned thread. Only if no new producer is ready by the time the brokers
abort the transaction themselves (transaction timeout + their sweep) does the stage stop.

Owns: the transaction in flight (``_flight``: future, outputs, batch) and when it began, a
producer replacement in progress, when offsets were last committed. Touches, of a partition:
its ``done``, ``dead_letters`` and ``tombstones`` queues, ``offsets_moved``, its dead-letter
watermarks (read), its buffer (marks groups published, expires ledger entries) and
``committed``. Uses: the publisher and the consumer's group metadata (clients), the publisher
thread, ``new_publisher`` (a started publisher with the stage's producer settings), the ledger
codec, the stats. An aborted or replaced transaction asks ``rewind`` to start every partition
over; a publication that cannot be recovered is reported to ``declare_fatal``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait

from confluent_kafka import KafkaException, TopicPartition

from stage.publish import Batch, PublishAborted, StageFatal
from stage.publish.deadletters import DEAD_LETTER_WATERMARK_KEY, watermark_entry
from stage.publish.transaction import COORDINATOR_CALLS, IDLE
from stage.runtime import exits
from stage.runtime.memory import PRODUCER_COPIES

logger = logging.getLogger("stage.runtime.loop")

# Kafka's transaction.abort.timed.out.transaction.cleanup.interval.ms (10 s) and a margin.
_ABORT_SWEEP_S = 15.0
_OFFSETS_ONLY_EVERY_S = 1.0   # a transaction carrying only moved offsets, at most this often
_FORCED_WAIT_STEP_S = 0.05


class Publication:
    def __init__(self, cfg, *, pool, clients, ledger_codec, clock, partitions, stats, rewind,
                 declare_fatal, new_publisher=None) -> None:
        self.cfg = cfg
        self.topics = cfg.topics
        self.pool = pool                    # DetachedWorker: one transaction at a time
        self.clients = clients
        self.ledger_codec = ledger_codec
        self.clock = clock
        self.partitions = partitions
        self.stats = stats
        self.rewind = rewind
        self.declare_fatal = declare_fatal
        self.new_publisher = new_publisher  # () -> a started publisher; None: no recovery
        self.stuck_after_s = min(cfg.publish_stuck_ms, cfg.transaction_timeout_ms) / 1000
        self._flight = None                 # (future, outputs, batch) or None
        self._flight_started = 0.0
        self._replacing: Future | None = None   # a new publisher being started
        self._stuck_phase, self._stuck_at = "", 0.0
        self._abandoned: list = []          # stuck publishers, kept referenced (never destroyed here)
        self._last_commit = time.monotonic()

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    @property
    def publishing_bytes(self) -> int:
        """The batch in flight, with librdkafka's copy of it (stage.runtime.memory)."""
        if self._flight is None:
            return 0
        return PRODUCER_COPIES * sum(len(record[3]) for record in self._flight[2].records if record[3])

    def publish(self, force: bool = False) -> None:
        """Keep one transaction in flight on the publisher thread while the loop goes on
        consuming and finalizing; apply its outcome when it completes. ``force``: publish
        everything finished now and wait (shutdown, revoke)."""
        if self._flight is not None:
            if force:
                self._wait_forced()
            elif not self._flight[0].done():
                self._watch()
                return
            if self._flight is None:        # replaced: the rewind starts everything over
                return
            self._land(*self._flight)
        while True:
            batch = self._next_batch(force)
            if batch is None:
                return
            future = self.pool.submit(self._timed_publish, batch[1])
            self._flight = (future, *batch)
            self._flight_started = time.monotonic()
            if not force:
                return
            self._wait_forced()
            if self._flight is None:
                return
            self._land(*self._flight)
            if not any(self.partitions.queued(q) for q in ("done", "dead_letters", "tombstones")):
                return

    def _next_batch(self, force: bool):
        parts = self.partitions
        done = parts.items("done")
        oldest = min((o.ready_at for o in done), default=None)
        moved = any(s.offsets_moved for s in parts)
        due = (force or len(done) >= self.cfg.publish_batch_groups or parts.queued("dead_letters")
               or (oldest is not None and time.monotonic() - oldest >= self.cfg.publish_linger_ms / 1000)
               or (moved and time.monotonic() - self._last_commit >= _OFFSETS_ONLY_EVERY_S))
        if not due:
            return None
        outputs = parts.take_oldest("done", self.cfg.publish_batch_groups)
        batch = Batch()
        for out in outputs:
            key = out.group_id.encode("utf-8")
            for topic, value in out.records:
                batch.records.append((topic, out.partition, key, value, None))
            batch.records.append((self.topics.stage_ledger, out.partition, key, out.ledger_value, None))
        dead_letters = parts.take_oldest("dead_letters")
        batch.records.extend(dl.record(self.topics.dead_letter) for dl in dead_letters)
        batch.records.extend(self._watermark_records({dl.source_partition for dl in dead_letters}))
        batch.records.extend(parts.take_oldest("tombstones"))
        batch.offsets = self._committable({(o.partition, o.group_id) for o in outputs})
        batch.group_metadata = self.clients.consumer.consumer_group_metadata()
        for state in parts:
            state.offsets_moved = False
        if not batch:
            return None
        return outputs, batch

    def _watermark_records(self, partitions) -> list:
        """The ledger entry that makes this transaction's dead letters exactly once."""
        now = self.clock.now_ms()
        out = []
        for p in sorted(partitions):
            state = self.partitions.get(p)
            marks = state.dead_letter_marks if state is not None else {}
            entry = watermark_entry(p, marks.get(self.topics.receipts, -1),
                                    marks.get(self.topics.staged_calls, -1), now)
            out.append((self.topics.stage_ledger, p, DEAD_LETTER_WATERMARK_KEY,
                        self.ledger_codec.encode(entry), None))
        return out

    def _timed_publish(self, batch: Batch) -> float:
        started = time.monotonic()
        self.clients.publisher.publish(batch, self.clients.consumer)
        return time.monotonic() - started

    # -- a publication that does not come back --------------------------------------------
    def _stall_deadline(self) -> float:
        """Past the transaction timeout (plus the brokers' abort sweep) a publication can no
        longer commit: the brokers abort it. A call still running then is stuck, not slow."""
        return self._flight_started + self.cfg.transaction_timeout_ms / 1000 + _ABORT_SWEEP_S

    def stuck(self) -> str | None:
        """Why the publication in flight counts as stuck (for readiness), or None."""
        if self._flight is None or self._flight[0].done():
            return None
        publisher = self.clients.publisher
        phase = getattr(publisher, "phase", IDLE)
        age = time.monotonic() - getattr(publisher, "phase_since", time.monotonic())
        if self._replacing is not None:
            return (f"publication stuck in {self._stuck_phase}: replacing the producer (fences the "
                    f"stuck one) for {time.monotonic() - self._stuck_at:.0f}s")
        if phase in COORDINATOR_CALLS and age > self.stuck_after_s:
            return f"publication stuck in {phase} for {age:.0f}s"
        return None

    def _watch(self) -> None:
        """The flight is not done: finish a replacement, start one, or give up."""
        if self._replacing is not None:
            if self._replacing.done():
                self._replaced()
                return
        elif self.new_publisher is not None and self.stuck() is not None:
            self._replace()
            return
        if time.monotonic() > self._stall_deadline():
            self._stalled()

    def _wait_forced(self) -> None:
        """Shutdown or revoke: wait for the flight, recovering it if it is stuck (bounded by
        the stall deadline)."""
        while self._flight is not None and not self._flight[0].done():
            self._watch()
            if self._flight is not None:
                wait([self._flight[0]], timeout=_FORCED_WAIT_STEP_S)

    def _replace(self) -> None:
        publisher = self.clients.publisher
        self._stuck_phase = publisher.phase
        self._stuck_at = time.monotonic()
        logger.error("publication stuck in %s for %.0fs (librdkafka #5511 after a broker restart); "
                     "starting a new producer with transactional.id %s to fence it and abort its "
                     "transaction", publisher.phase, time.monotonic() - publisher.phase_since,
                     self.cfg.effective_transactional_id)
        self.stats.inc("publication_stuck")
        self._replacing = Future()
        threading.Thread(target=self._start_publisher, args=(self._replacing,),
                         name="publisher-replacement", daemon=True).start()

    def _start_publisher(self, result: Future) -> None:
        """Start a new publisher, retrying while the brokers cannot answer, until the stall
        deadline (then the stage stops as before)."""
        deadline = self._stall_deadline()
        while True:
            try:
                result.set_result(self.new_publisher())
                return
            except KafkaException as error:
                err = error.args[0]
                if err.fatal() or time.monotonic() > deadline:
                    result.set_exception(error)
                    return
                logger.warning("the replacement producer could not start yet (%s); retrying", err)
                time.sleep(1.0)
            except BaseException as error:  # noqa: BLE001 - handed to the loop thread
                result.set_exception(error)
                return

    def _replaced(self) -> None:
        """The new producer fenced the stuck one: abandon the stuck call and start over."""
        replacing, self._replacing = self._replacing, None
        try:
            publisher = replacing.result()
        except Exception as error:  # noqa: BLE001 - no producer: stop as a stuck publication does
            logger.error("no replacement producer (%s: %s)", type(error).__name__, error)
            self._stalled()
        self._abandoned.append(self.clients.publisher)
        self.clients.publisher = publisher
        self.pool.abandon()
        self._flight = None
        seconds = time.monotonic() - self._stuck_at
        self.stats.inc("publication_recoveries")
        self.stats.observe("publication_recovery_seconds", seconds)
        logger.warning("new producer ready %.1fs after the publication was found stuck; the stuck "
                       "transaction is aborted, rewinding to the committed offsets", seconds)
        self.rewind()

    def _stalled(self) -> None:
        age = time.monotonic() - self._flight_started
        logger.error("publication stuck for %.0fs in the Kafka client; stopping", age)
        fatal = exits.publish_stalled(age, self.cfg.effective_transactional_id)
        self.declare_fatal(fatal)
        raise fatal

    # -- a publication that came back ------------------------------------------------------
    def _land(self, future, outputs, batch) -> None:
        """Apply a finished publication: mark its groups published, or rewind after an abort."""
        self._flight = None
        try:
            seconds = future.result()
            self.clients.publisher.commit_offsets(batch, self.clients.consumer)  # at-least-once only
        except PublishAborted as error:
            logger.warning("publication aborted (%s); rewinding to the committed offsets", error)
            self.stats.inc("transactions_aborted")
            self.rewind()
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
            state = self.partitions.get(out.partition)
            if state is not None and state.buffer is not None and out.group_id in state.buffer.groups:
                state.buffer.mark_published(out.group_id, now)
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
        for state in self.partitions.loaded():
            excluding = {group_id for p, group_id in publishing if p == state.number}
            for topic in (self.topics.receipts, self.topics.staged_calls):
                candidate = state.buffer.committable(topic, state.committed.get(topic), excluding=excluding)
                if candidate is not None:
                    offsets.append(TopicPartition(topic, state.number, candidate))
        return offsets

    def _remember_committed(self, offsets: list[TopicPartition]) -> None:
        for tp in offsets:
            state = self.partitions.get(tp.partition)
            if state is not None:
                state.committed[tp.topic] = tp.offset
        now = self.clock.now_ms()
        for state in self.partitions.loaded():
            for group_id in state.buffer.expire_published(state.committed, now):
                state.tombstones.append((self.partitions.stamp(), (
                    self.topics.stage_ledger, state.number, group_id.encode("utf-8"), None, None)))

    def committed_offsets(self) -> dict[str, int]:
        """``topic[partition]`` -> the offset this process last committed there (for logs)."""
        return {f"{topic}[{s.number}]": offset for s in self.partitions
                for topic, offset in sorted(s.committed.items())}
