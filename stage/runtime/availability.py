"""Is an input partition read to its end? Asked of the brokers, never of a cache.

Deadlines fire only once both input partitions of a group have been read past the deadline or
to their end (a stage catching up must not finalize groups whose records it has not read yet).
"Read to its end" used to come from librdkafka's cached high watermark, which goes stale when a
partition's leader dies: the fetches fail, the cache stays, the stage looked caught up and
expired groups whose records were only delayed by the failover.

``EndOffsetProbe`` asks the leaders (ListOffsets, read_committed: the last stable offset) for
every assigned input partition, asynchronously (admin futures: the loop never waits), every
``interval_s`` and at once when a deadline becomes due. A partition is *available* once its
probes have answered continuously for ``settle_s`` (after a failover, producers need a moment
to deliver what they held back), and *read to its end as of T* when an answer asked at time T
(after the settle) is at or below the consumer's position. A deadline D counts as passed for a
topic when T >= D: every record acknowledged before D has then been read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import OffsetSpec

logger = logging.getLogger(__name__)


@dataclass
class _Probe:
    asked_ms: int
    futures: dict            # TopicPartition -> future


@dataclass
class PartitionView:
    """What the probe knows of one input topic-partition."""

    available_since_ms: int | None = None   # first answer after the last failure
    failed_at_ms: int | None = None
    failure: str | None = None
    end_offset: int | None = None
    asked_ms: int = -1                      # when the latest answer was asked for
    read_to_end_ms: int = -1                # latest T at which the position reached the end


class EndOffsetProbe:
    def __init__(self, admin, now_ms, *, interval_s: float = 1.0, settle_s: float = 3.0,
                 timeout_s: float = 5.0, slow_s: float = 2.0) -> None:
        self.admin = admin
        self.now_ms = now_ms
        self.interval_ms = int(interval_s * 1000)
        self.settle_ms = int(settle_s * 1000)
        self.timeout_s = timeout_s
        self.slow_ms = int(slow_s * 1000)   # a probe unanswered this long: the leader is not answering
        self.views: dict[tuple[str, int], PartitionView] = {}
        self._inflight: _Probe | None = None
        self._last_asked_ms = -1

    # -- probing ---------------------------------------------------------------------------
    def track(self, tps: list[tuple[str, int]]) -> None:
        """The assigned input topic-partitions (others are forgotten)."""
        keep = set(tps)
        for key in list(self.views):
            if key not in keep:
                del self.views[key]
        for key in tps:
            self.views.setdefault(key, PartitionView())

    def poll(self, *, urgent: bool = False) -> None:
        """Harvest a finished probe; start the next one when due (or now, if ``urgent``)."""
        now = self.now_ms()
        if self._inflight is not None:
            if not all(f.done() for f in self._inflight.futures.values()):
                if now - self._inflight.asked_ms <= self.timeout_s * 1000 + 1000:
                    return
                self._fail_pending(self._inflight, "no answer from the partition leader")
            else:
                self._harvest(self._inflight)
            self._inflight = None
        if not self.views:
            return
        if not urgent and now - self._last_asked_ms < self.interval_ms:
            return
        request = {TopicPartition(t, p): OffsetSpec.latest() for t, p in self.views}
        try:
            futures = self.admin.list_offsets(request, isolation_level=IsolationLevel.READ_COMMITTED,
                                              request_timeout=self.timeout_s)
        except (KafkaException, ValueError, TypeError) as error:
            for key in self.views:
                self._failed(key, now, f"ListOffsets not sent: {error}")
            self._last_asked_ms = now
            return
        self._inflight = _Probe(now, futures)
        self._last_asked_ms = now

    def _harvest(self, probe: _Probe) -> None:
        answered = self.now_ms()
        for tp, future in probe.futures.items():
            key = (tp.topic, tp.partition)
            if key not in self.views:
                continue
            try:
                offset = future.result().offset
            except Exception as error:  # noqa: BLE001 - KafkaException, cancelled: unavailable
                self._failed(key, answered, str(error))
                continue
            if offset < 0:   # an answer without an offset: no leader could say
                self._failed(key, answered, "no end offset in the answer (leader unknown)")
                continue
            view = self.views[key]
            if view.available_since_ms is None:
                view.available_since_ms = probe.asked_ms
                if view.failure is not None:
                    logger.info("input partition %s[%d] answers again (was: %s)", tp.topic, tp.partition,
                                view.failure)
                view.failure = None
            view.end_offset, view.asked_ms = offset, probe.asked_ms

    def _fail_pending(self, probe: _Probe, why: str) -> None:
        now = self.now_ms()
        for tp, future in probe.futures.items():
            key = (tp.topic, tp.partition)
            if key in self.views and not future.done():
                self._failed(key, now, why)
            elif key in self.views:
                self._harvest(_Probe(probe.asked_ms, {tp: future}))

    def _failed(self, key, now_ms: int, why: str) -> None:
        view = self.views[key]
        if view.failure is None:
            logger.warning("input partition %s[%d] unavailable: %s; deadlines of its groups wait",
                           key[0], key[1], why)
        view.available_since_ms, view.failed_at_ms, view.failure = None, now_ms, why
        view.end_offset, view.asked_ms = None, -1

    # -- what the loop asks -----------------------------------------------------------------
    def settled(self, topic: str, partition: int) -> bool:
        view = self.views.get((topic, partition))
        return (view is not None and view.available_since_ms is not None
                and view.asked_ms - view.available_since_ms >= self.settle_ms)

    def available(self, topic: str, partition: int) -> bool:
        view = self.views.get((topic, partition))
        return (view is not None and view.available_since_ms is not None
                and not self._unanswered(topic, partition))

    def _unanswered(self, topic: str, partition: int) -> bool:
        """Asked for more than ``slow_s`` ago and still no answer (a dead leader)."""
        probe = self._inflight
        if probe is None or self.now_ms() - probe.asked_ms < self.slow_ms:
            return False
        future = probe.futures.get(TopicPartition(topic, partition))
        return future is not None and not future.done()

    def why_unavailable(self, topic: str, partition: int) -> str:
        view = self.views.get((topic, partition))
        if view is not None and view.failure:
            return view.failure
        if self._unanswered(topic, partition):
            return f"its leader has not answered for {(self.now_ms() - self._inflight.asked_ms) / 1000:.0f}s"
        return "not answering yet"

    def note_position(self, topic: str, partition: int, position: int) -> int:
        """Record the consumer's position; returns the latest time it was read to its end."""
        view = self.views.get((topic, partition))
        if view is None:
            return -1
        if (view.end_offset is not None and position >= 0 and position >= view.end_offset
                and self.settled(topic, partition)):
            view.read_to_end_ms = max(view.read_to_end_ms, view.asked_ms)
        return view.read_to_end_ms

    def invalidate(self, topic: str, partition: int) -> None:
        """The position went back (a record is re-read): earlier read-to-end claims are void."""
        view = self.views.get((topic, partition))
        if view is not None:
            view.read_to_end_ms = -1


class StartOffsets:
    """Where the consumer began fetching a partition it has consumed nothing from yet
    (librdkafka reports no position until the first record): the group's committed offset, or
    the log start when none is committed (auto.offset.reset=earliest). Asked of the brokers
    asynchronously, like the end offsets, so the loop never waits on a coordinator that is
    failing over."""

    def __init__(self, admin, group_id: str, *, timeout_s: float = 5.0, retry_s: float = 1.0) -> None:
        self.admin, self.group_id = admin, group_id
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.known: dict[tuple[str, int], int] = {}
        self._pending: dict[tuple[str, int], tuple[str, object]] = {}
        self._retry_at: dict[tuple[str, int], float] = {}

    def get(self, topic: str, partition: int, now_s: float) -> int:
        """The start offset, or -1 while it is being asked for."""
        key = (topic, partition)
        if key in self.known:
            return self.known[key]
        pending = self._pending.get(key)
        if pending is not None:
            self._harvest(key, *pending, now_s)
        elif now_s >= self._retry_at.get(key, 0.0):
            self._ask_committed(key)
        return self.known.get(key, -1)

    def forget(self, topic: str, partition: int) -> None:
        key = (topic, partition)
        self.known.pop(key, None)
        self._pending.pop(key, None)
        self._retry_at.pop(key, None)

    def _ask_committed(self, key) -> None:
        from confluent_kafka import ConsumerGroupTopicPartitions
        request = ConsumerGroupTopicPartitions(self.group_id, [TopicPartition(*key)])
        try:
            futures = self.admin.list_consumer_group_offsets([request], require_stable=True,
                                                             request_timeout=self.timeout_s)
        except (KafkaException, ValueError, TypeError):
            return
        self._pending[key] = ("committed", futures[self.group_id])

    def _harvest(self, key, kind: str, future, now_s: float) -> None:
        if not future.done():
            return
        del self._pending[key]
        try:
            result = future.result()
        except Exception:  # noqa: BLE001 - coordinator or leader unavailable: ask again later
            self._retry_at[key] = now_s + self.retry_s
            return
        if kind == "committed":
            offset = result.topic_partitions[0].offset
            if offset >= 0:
                self.known[key] = offset
                return
            tp = TopicPartition(*key)
            try:
                futures = self.admin.list_offsets({tp: OffsetSpec.earliest()}, request_timeout=self.timeout_s)
            except (KafkaException, ValueError, TypeError):
                self._retry_at[key] = now_s + self.retry_s
                return
            self._pending[key] = ("earliest", futures[tp])
        elif result.offset >= 0:
            self.known[key] = result.offset
        else:
            self._retry_at[key] = now_s + self.retry_s
