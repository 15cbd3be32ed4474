"""Two or three fakes the runtime's steps are tested with, no broker: a consumer that records
what the runtime asks of it, an end-offset probe that says every partition is read to its end,
a publisher that records the batches it is given, a worker pool whose results the test sets."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from confluent_kafka import TopicPartition


class Message:
    def __init__(self, topic, partition, offset, key, value, ts=1_000):
        self._t, self._p, self._o, self._k, self._v, self._ts = topic, partition, offset, key, value, ts

    def error(self):
        return None

    def topic(self):
        return self._t

    def partition(self):
        return self._p

    def offset(self):
        return self._o

    def key(self):
        return self._k

    def value(self):
        return self._v

    def headers(self):
        return []

    def timestamp(self):
        return (1, self._ts)


class Consumer:
    """Records assign / unassign / pause / resume / seek; ``batches`` are what consume returns."""

    def __init__(self, committed: int = 0):
        self.calls, self.batches, self.committed_at = [], [], committed
        self.assigned: set[tuple[str, int]] = set()
        self.paused: set[tuple[str, int]] = set()

    def consume(self, num_messages=1, timeout=0):
        return self.batches.pop(0) if self.batches else []

    def incremental_assign(self, tps):
        self.assigned |= {(tp.topic, tp.partition) for tp in tps}

    def incremental_unassign(self, tps):
        self.assigned -= {(tp.topic, tp.partition) for tp in tps}
        self.paused -= {(tp.topic, tp.partition) for tp in tps}

    def pause(self, tps):
        self.paused |= {(tp.topic, tp.partition) for tp in tps}

    def resume(self, tps):
        self.paused -= {(tp.topic, tp.partition) for tp in tps}

    def seek(self, tp):
        self.calls.append(("seek", tp.topic, tp.partition, tp.offset))

    def committed(self, tps, timeout=None):
        return [TopicPartition(tp.topic, tp.partition, self.committed_at) for tp in tps]

    def get_watermark_offsets(self, tp, timeout=None, cached=False):
        return (0, 0)

    def position(self, tps):
        return [TopicPartition(tp.topic, tp.partition, -1) for tp in tps]

    def consumer_group_metadata(self):
        return "group-metadata"

    def unsubscribe(self):
        self.calls.append(("unsubscribe",))

    def poll(self, timeout=None):
        return None

    def close(self):
        self.calls.append(("close",))


class Probe:
    """Every input partition is available and read to its end."""

    def __init__(self):
        self.tracked, self.invalidated = [], []

    def track(self, tps):
        self.tracked = list(tps)

    def invalidate(self, topic, partition):
        self.invalidated.append((topic, partition))

    def poll(self, urgent=None):
        pass

    def note_position(self, topic, partition, position):
        """The latest time the position was at the end: now, while the partition answers."""
        return 1 << 62 if self.available(topic, partition) else -1

    def available(self, topic, partition):
        return True


class StartOffsets:
    def forget(self, topic, partition):
        pass

    def get(self, topic, partition, now):
        return 0


class Publisher:
    """Records each batch; ``fail`` makes the next publication raise it."""

    phase, phase_since = "idle", 0.0

    def __init__(self):
        self.batches, self.fail = [], None

    def publish(self, batch, consumer):
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        self.batches.append(batch)

    def commit_offsets(self, batch, consumer):
        pass

    def close(self, timeout_s=None):
        pass


class Workers:
    """A finalize pool whose futures the test completes (``results``: group id -> Outputs)."""

    def __init__(self):
        self.submitted, self.futures = [], {}

    def submit(self, group, why, epoch):
        future = Future()
        self.submitted.append((group.group_id, epoch))
        self.futures[group.group_id] = future
        return future

    def warm(self, timeout_s=0.0):
        pass

    def shutdown(self, wait=True, cancel_futures=False):
        pass


class NeverLoads:
    """A loader pool whose loads never finish (the partition stays loading)."""

    def submit(self, fn, *args):
        return Future()

    def shutdown(self, wait=True, cancel_futures=False):
        pass


def connect(runtime, consumer: Consumer) -> None:
    """What StageRuntime.start makes, as fakes (the runtime is never started)."""
    runtime.clients.consumer = consumer
    runtime.clients.probe = Probe()
    runtime.clients.start_offsets = StartOffsets()
    runtime.flight.publisher = Publisher()
    runtime.partition_count = 4


def stats_fake():
    return SimpleNamespace(inc=lambda *a, **k: None, set=lambda *a: None, observe=lambda *a: None)
