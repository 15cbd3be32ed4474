"""PauseSet (independent reasons per partition) and SchemaResolver (registry lookups off the
loop, back-off through an outage) without a broker."""

import time

from stage.runtime.pauses import BACKPRESSURE, LOADING, REGISTRY, PauseSet
from stage.runtime.registry import SchemaResolver
from stage.wire import RegistryError


class Consumer:
    def __init__(self):
        self.calls = []

    def pause(self, tps):
        self.calls.append(("pause", sorted((tp.topic, tp.partition) for tp in tps)))

    def resume(self, tps):
        self.calls.append(("resume", sorted((tp.topic, tp.partition) for tp in tps)))


def test_a_partition_resumes_only_when_no_reason_holds_it():
    pauses, consumer = PauseSet(("r", "s")), Consumer()
    pauses.hold(0, LOADING)
    pauses.hold(0, BACKPRESSURE)
    pauses.hold(1, BACKPRESSURE)
    pauses.apply(consumer, [0, 1])
    assert consumer.calls == [("pause", [("r", 0), ("r", 1), ("s", 0), ("s", 1)])]
    pauses.release_everywhere(BACKPRESSURE)
    pauses.apply(consumer, [0, 1])
    assert consumer.calls[-1] == ("resume", [("r", 1), ("s", 1)])   # 0 still loading
    assert pauses.why(0) == {LOADING} and pauses.paused_count == 1
    pauses.apply(consumer, [0, 1])
    assert len(consumer.calls) == 2                                    # nothing changed: no call
    pauses.release(0, LOADING)
    pauses.apply(consumer, [0, 1])
    assert consumer.calls[-1] == ("resume", [("r", 0), ("s", 0)]) and pauses.paused_count == 0


def test_forgotten_partitions_are_not_resumed_after_they_left_the_assignment():
    pauses, consumer = PauseSet(("r", "s")), Consumer()
    pauses.hold(3, REGISTRY)
    pauses.apply(consumer, [3])
    pauses.forget([3])
    pauses.apply(consumer, [])
    assert consumer.calls == [("pause", [("r", 3), ("s", 3)])] and pauses.holding(REGISTRY) == []


class Codec:
    schema_name = "ReceiptEvent"

    def __init__(self, failures):
        self.failures, self.calls = failures, 0

    def prefetch(self, schema_id):
        self.calls += 1
        if self.calls <= self.failures:
            raise RegistryError("Schema Registry failed: ConnectionError", retriable=True)


def _wait(resolver, until, seconds=5.0):
    deadline = time.monotonic() + seconds
    released = set()
    while time.monotonic() < deadline:
        released |= resolver.poll()
        if until(released):
            return released
        time.sleep(0.01)
    raise AssertionError(f"released {released}")


def test_an_outage_keeps_partitions_waiting_with_back_off_then_releases_them():
    resolver = SchemaResolver(min_backoff_s=0.05, max_backoff_s=0.2)
    codec = Codec(failures=3)
    resolver.request(codec, 101, partition=0)
    resolver.request(codec, 101, partition=2)
    _wait(resolver, lambda r: resolver.unavailable)
    assert "ConnectionError" in resolver.last_error
    released = _wait(resolver, lambda r: r == {0, 2})
    assert released == {0, 2} and codec.calls == 4 and not resolver.unavailable
    resolver.close()


def test_a_partition_waits_for_every_schema_it_needs():
    resolver = SchemaResolver(min_backoff_s=0.05)
    fine, broken = Codec(failures=0), Codec(failures=1000)
    broken.schema_name = "StagedCall"
    resolver.request(fine, 1, partition=0)
    resolver.request(broken, 2, partition=0)
    time.sleep(0.3)
    assert resolver.poll() == set() and resolver.unavailable   # schema 1 resolved, 2 still not
    resolver.forget([0])
    assert not resolver.requests or all(not r.partitions for r in resolver.requests.values())
    resolver.close()
