"""Is an input partition read to its end? Asked of the brokers, never of a cache.

Deadlines fire only once both input partitions of a group have been read past the deadline or
to their end (a stage catching up must not finalize groups whose records it has not read yet).
"Read to its end" used to come from librdkafka's cached high watermark, which goes stale when a
partition's leader dies: the fetches fail, the cache stays, the stage looked caught up and
expired groups whose records were only delayed by the failover.

``EndOffsetProbe`` asks the leaders (stage.runtime.kafka.probes: the last stable offset, one
partition per request, off the loop thread) for every assigned input partition every
``interval_s``, and at once when a deadline becomes due. A partition is *available* once its
probes have answered continuously for ``settle_s`` (after a failover, producers need a moment
to deliver what they held back); a question unanswered for ``slow_s`` makes it unavailable at
once. It is *read to its end as of T* when an answer asked at time T (after the settle) is at
or below the consumer's position. A deadline D counts as passed for a topic when T >= D: every
record acknowledged before D has then been read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# How long a partition's probes must answer before it counts as read to its end: producers
# deliver what they held back during an outage within this (docs/producers.md asks them to
# reconnect within a second; librdkafka's default back-off is up to 10 s).
SETTLE_S = 3.0


@dataclass
class PartitionView:
    """What the probe knows of one input topic-partition."""

    available_since_ms: int | None = None   # first answer after the last failure
    failed_at_ms: int | None = None
    failure: str | None = None
    end_offset: int | None = None
    asked_ms: int = -1                      # when the latest answer was asked for
    read_to_end_ms: int = -1                # latest T at which the position reached the end
    pending: object = None                  # the question in flight (a Future)
    pending_since_ms: int = -1


class EndOffsetProbe:
    def __init__(self, queries, now_ms, *, interval_s: float = 1.0, settle_s: float = SETTLE_S,
                 slow_s: float = 2.0) -> None:
        self.queries = queries
        self.now_ms = now_ms
        self.interval_ms = int(interval_s * 1000)
        self.settle_ms = int(settle_s * 1000)
        self.slow_ms = int(slow_s * 1000)
        self.views: dict[tuple[str, int], PartitionView] = {}

    # -- probing ---------------------------------------------------------------------------
    def track(self, tps: list[tuple[str, int]]) -> None:
        """The assigned input topic-partitions (others are forgotten)."""
        keep = set(tps)
        for key in list(self.views):
            if key not in keep:
                del self.views[key]
        for key in tps:
            self.views.setdefault(key, PartitionView())

    def poll(self, *, urgent=()) -> None:
        """Harvest answers; ask again where due (every ``interval_s``, or now for ``urgent``
        keys whose latest answer was asked for before ``urgent[key]``)."""
        now = self.now_ms()
        urgent = dict(urgent)
        for key, view in self.views.items():
            if view.pending is not None:
                if not view.pending.done():
                    continue
                self._harvest(key, view)
            last = max(view.asked_ms, -1 if view.failed_at_ms is None else view.failed_at_ms)
            due = last < 0 or now - last >= self.interval_ms
            if due or view.asked_ms < urgent.get(key, -1):
                view.pending, view.pending_since_ms = self.queries.end_offset(*key), now

    def _harvest(self, key, view: PartitionView) -> None:
        future, asked = view.pending, view.pending_since_ms
        view.pending = None
        try:
            offset = future.result()
        except Exception as error:  # noqa: BLE001 - timed out, no leader, cancelled: unavailable
            self._failed(key, view, str(error) or type(error).__name__)
            return
        if offset < 0:   # an answer without an offset: no leader could say
            self._failed(key, view, "no end offset in the answer (leader unknown)")
            return
        if view.available_since_ms is None:
            view.available_since_ms = asked
            if view.failure is not None:
                logger.info("input partition %s[%d] answers again (was: %s)", key[0], key[1], view.failure)
            view.failure = None
        view.end_offset, view.asked_ms = offset, asked

    def _failed(self, key, view: PartitionView, why: str) -> None:
        if view.failure is None:
            logger.warning("input partition %s[%d] unavailable: %s; deadlines of its groups wait",
                           key[0], key[1], why)
        view.available_since_ms, view.failed_at_ms, view.failure = None, self.now_ms(), why
        view.end_offset, view.asked_ms = None, -1

    # -- what the loop asks -----------------------------------------------------------------
    def settled(self, topic: str, partition: int) -> bool:
        view = self.views.get((topic, partition))
        return (view is not None and view.available_since_ms is not None
                and view.asked_ms - view.available_since_ms >= self.settle_ms)

    def available(self, topic: str, partition: int) -> bool:
        view = self.views.get((topic, partition))
        return (view is not None and view.available_since_ms is not None
                and not self._unanswered(view))

    def _unanswered(self, view: PartitionView) -> bool:
        """Asked more than ``slow_s`` ago and still no answer (a dead leader)."""
        return (view.pending is not None and not view.pending.done()
                and self.now_ms() - view.pending_since_ms >= self.slow_ms)

    def why_unavailable(self, topic: str, partition: int) -> str:
        view = self.views.get((topic, partition))
        if view is None:
            return "not assigned"
        if self._unanswered(view):
            return f"its leader has not answered for {(self.now_ms() - view.pending_since_ms) / 1000:.0f}s"
        return view.failure or "not answering yet"

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
    the log start when none is committed (auto.offset.reset=earliest). Asked of the brokers off
    the loop thread, like the end offsets, so the loop never waits on a coordinator that is
    failing over."""

    def __init__(self, queries, *, retry_s: float = 1.0) -> None:
        self.queries, self.retry_s = queries, retry_s
        self.known: dict[tuple[str, int], int] = {}
        self._pending: dict[tuple[str, int], object] = {}
        self._retry_at: dict[tuple[str, int], float] = {}

    def get(self, topic: str, partition: int, now_s: float) -> int:
        """The start offset, or -1 while it is being asked for."""
        key = (topic, partition)
        if key in self.known:
            return self.known[key]
        future = self._pending.get(key)
        if future is not None and future.done():
            del self._pending[key]
            try:
                self.known[key] = future.result()
            except Exception:  # noqa: BLE001 - coordinator or leader unavailable: ask again later
                self._retry_at[key] = now_s + self.retry_s
        elif future is None and now_s >= self._retry_at.get(key, 0.0):
            self._pending[key] = self.queries.start_offset(topic, partition)
        return self.known.get(key, -1)

    def forget(self, topic: str, partition: int) -> None:
        key = (topic, partition)
        self.known.pop(key, None)
        self._pending.pop(key, None)
        self._retry_at.pop(key, None)
