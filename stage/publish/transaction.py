"""Publishing a batch of finalized groups together with the input offsets they cover.

Exactly-once: one Kafka transaction per batch holds the output records, a ledger entry per
group, dead letters and tombstones, and the committable input offsets
(``send_offsets_to_transaction`` with the consumer's group metadata, KIP-447). Errors follow
the three-way taxonomy: retriable -> retry the same call; abortable -> abort, the caller
rewinds and rebuilds; fatal (fenced, ...) -> stop and let the supervisor restart.
At-least-once: produce, wait for every delivery, then commit the offsets.

A publisher says which call it is in (``phase``) and since when, so the runtime can tell a
publication that is slow (producing a large batch) from one stuck in a coordinator call that
should take milliseconds (librdkafka #5511: send_offsets_to_transaction after a broker restart).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from confluent_kafka import KafkaException, Producer

from stage.publish.faults import crash_point

logger = logging.getLogger(__name__)


class PublishAborted(RuntimeError):
    """The batch was not published; rewind to the committed offsets and rebuild."""


class StageFatal(RuntimeError):
    """The producer is fenced or broken; the process must stop."""


@dataclass(eq=False)
class Batch:
    records: list = field(default_factory=list)   # (topic, partition|None, key bytes, value|None, headers)
    offsets: list = field(default_factory=list)   # TopicPartition(topic, partition, next offset)
    # The consumer's group metadata (KIP-447), taken on the loop thread when the batch is built.
    group_metadata: object = None

    def __bool__(self) -> bool:
        return bool(self.records or self.offsets)


def _call(what: str, fn, *args, attempts: int = 5):
    for attempt in range(attempts):
        try:
            return fn(*args)
        except KafkaException as e:
            err = e.args[0]
            if err.retriable() and attempt + 1 < attempts:
                logger.warning("%s: retriable error %s; retrying", what, err)
                time.sleep(0.1 * (attempt + 1))
                continue
            raise


def _classify(e: KafkaException) -> Exception:
    err = e.args[0]
    if err.fatal():
        return StageFatal(f"fatal producer error: {err}")
    if err.txn_requires_abort():
        return PublishAborted(f"transaction must abort: {err}")
    if err.retriable():
        return PublishAborted(f"retriable error persisted: {err}")
    return StageFatal(f"unclassified transaction error: {err}")


IDLE = "idle"
PRODUCE = "produce"
FLUSH = "flush"
# Calls that only talk to a coordinator: their time does not grow with the batch.
BEGIN, SEND_OFFSETS, COMMIT, ABORT = ("begin_transaction", "send_offsets_to_transaction",
                                      "commit_transaction", "abort_transaction")
COORDINATOR_CALLS = frozenset({BEGIN, SEND_OFFSETS, COMMIT, ABORT})


class _Publisher:
    """What both modes share: the producer, counters, produce-with-queue-backoff, and the
    phase of the publication in progress."""

    def __init__(self, producer: Producer, timeout_s: float = 60.0) -> None:
        self.producer = producer
        self.timeout_s = timeout_s
        self.committed = 0
        self.aborted = 0
        self.phase = IDLE
        self.phase_since = time.monotonic()

    def _enter(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.monotonic()

    def start(self) -> None:
        pass

    def outstanding(self) -> int:
        """Records the producer holds: queued, or sent and not acknowledged yet."""
        return len(self.producer)

    def _produce(self, topic, partition, key, value, headers, on_delivery=None) -> None:
        kwargs = {"key": key, "value": value, "headers": headers}
        if partition is not None:
            kwargs["partition"] = partition
        if on_delivery is not None:
            kwargs["on_delivery"] = on_delivery
        while True:
            try:
                self.producer.produce(topic, **kwargs)
                break
            except BufferError:
                self.producer.poll(0.05)  # the local queue is full: serve delivery reports
        self.producer.poll(0)

    def abort(self) -> None:
        pass

    def commit_offsets(self, batch: "Batch", consumer) -> None:
        """Called on the consumer's (loop) thread after ``publish`` returned: librdkafka serves
        a synchronous commit's result through the consumer, so it must not run beside poll()."""

    def close(self, timeout_s: float | None = None) -> None:
        """Deliver what is queued (at-least-once), then let the producer go. A producer that
        failed fatally (fenced, or its transaction aborted by the brokers) raises from flush:
        that is logged, never raised, so it cannot hide the error that stopped the stage."""
        try:
            left = self.producer.flush(self.timeout_s if timeout_s is None else timeout_s)
        except KafkaException as error:
            logger.warning("closing the producer: %s (nothing is lost: what was not committed is "
                           "re-read from the committed offsets)", error.args[0])
            return
        if left:
            logger.warning("closing the producer: %d records not delivered", left)


class TransactionalPublisher(_Publisher):
    def start(self) -> None:
        _call("init_transactions", self.producer.init_transactions, self.timeout_s)

    def publish(self, batch: Batch, consumer) -> None:
        if not batch:
            return
        try:
            crash_point("before_begin")
            self._enter(BEGIN)
            _call("begin_transaction", self.producer.begin_transaction)
            self._enter(PRODUCE)
            for topic, partition, key, value, headers in batch.records:
                self._produce(topic, partition, key, value, headers)
            self._enter(FLUSH)
            self.producer.flush(self.timeout_s)
            crash_point("after_produce")
            if batch.offsets:
                self._enter(SEND_OFFSETS)
                _call("send_offsets_to_transaction", self.producer.send_offsets_to_transaction,
                      batch.offsets, batch.group_metadata or consumer.consumer_group_metadata(),
                      self.timeout_s)
            crash_point("before_commit")
            self._enter(COMMIT)
            _call("commit_transaction", self.producer.commit_transaction, self.timeout_s)
            crash_point("after_commit")
            self.committed += 1
        except KafkaException as e:
            error = _classify(e)
            if isinstance(error, PublishAborted):
                self.abort()
            raise error from e
        except BufferError as e:
            self.abort()
            raise PublishAborted(f"producer queue full: {e}") from e
        finally:
            self._enter(IDLE)

    def abort(self) -> None:
        self._enter(ABORT)
        try:
            self.producer.abort_transaction(self.timeout_s)
            self.aborted += 1
        except KafkaException as e:
            err = e.args[0]
            if err.fatal():
                raise StageFatal(f"abort failed fatally: {err}") from e
            logger.warning("abort_transaction: %s", err)
        finally:
            self._enter(IDLE)


class AtLeastOncePublisher(_Publisher):
    """Produce, wait for every delivery report, then commit offsets (duplicates possible after
    a crash between the two; the ledger still prevents republication of published groups)."""

    def start(self) -> None:
        """A metadata answer: the brokers are reachable (after an outage this is what says
        publishing works again). Raises KafkaException (retriable) when none answers."""
        self.producer.list_topics(timeout=self.timeout_s)

    def publish(self, batch: Batch, consumer) -> None:
        if not batch:
            return
        failures: list = []

        def report(err, msg):
            if err is not None:
                failures.append(err)

        self._enter(PRODUCE)
        for topic, partition, key, value, headers in batch.records:
            self._produce(topic, partition, key, value, headers, on_delivery=report)
        self._enter(FLUSH)
        remaining = self.producer.flush(self.timeout_s)
        self._enter(IDLE)
        if remaining or failures:
            self.aborted += 1
            raise PublishAborted(f"{remaining} undelivered, {len(failures)} failed: {failures[:3]}")
        crash_point("after_produce")

    def commit_offsets(self, batch: Batch, consumer) -> None:
        if batch.offsets:
            try:
                crash_point("before_commit")
                consumer.commit(offsets=batch.offsets, asynchronous=False)
                crash_point("after_commit")
            except KafkaException as e:
                self.aborted += 1
                raise PublishAborted(f"offset commit failed: {e.args[0]}") from e
        self.committed += 1
