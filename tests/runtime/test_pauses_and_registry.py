"""PauseSet (independent reasons per partition) and SchemaResolver (registry lookups off the
loop, back-off through an outage) without a broker."""

import time

from concurrent.futures import Future

from stage.runtime.state.partition import Partitions
from stage.runtime.state.pauses import BACKPRESSURE, HALTED, LOADING, REGISTRY, SHUTDOWN, PauseSet, reasons_of
from stage.runtime.kafka.registry import SchemaResolver
from stage.wire import RegistryError


class Consumer:
    def __init__(self):
        self.calls = []

    def pause(self, tps):
        self.calls.append(("pause", sorted((tp.topic, tp.partition) for tp in tps)))

    def resume(self, tps):
        self.calls.append(("resume", sorted((tp.topic, tp.partition) for tp in tps)))


def _reasons(**held):
    return {int(p[1:]): frozenset(why) for p, why in held.items()}


def test_a_partition_resumes_only_when_no_reason_holds_it():
    pauses, consumer = PauseSet(("r", "s")), Consumer()
    pauses.apply(consumer, _reasons(p0={LOADING, BACKPRESSURE}, p1={BACKPRESSURE}))
    assert consumer.calls == [("pause", [("r", 0), ("r", 1), ("s", 0), ("s", 1)])]
    pauses.apply(consumer, _reasons(p0={LOADING}, p1=set()))
    assert consumer.calls[-1] == ("resume", [("r", 1), ("s", 1)])   # 0 still loading
    assert pauses.why(0) == {LOADING} and pauses.paused_count == 1
    pauses.apply(consumer, _reasons(p0={LOADING}, p1=set()))
    assert len(consumer.calls) == 2                                    # nothing changed: no call
    pauses.apply(consumer, _reasons(p0=set(), p1=set()))
    assert consumer.calls[-1] == ("resume", [("r", 0), ("s", 0)]) and pauses.paused_count == 0


def test_partitions_that_left_the_assignment_are_not_resumed():
    pauses, consumer = PauseSet(("r", "s")), Consumer()
    pauses.apply(consumer, _reasons(p3={REGISTRY}))
    pauses.apply(consumer, {})                      # 3 was revoked: librdkafka dropped its flags
    assert consumer.calls == [("pause", [("r", 3), ("s", 3)])] and pauses.holding(REGISTRY) == []
    assert pauses.paused_count == 0


def test_the_reasons_are_read_from_who_owns_each_cause():
    parts = Partitions()
    loading, halted, waiting, free = (parts.add(p) for p in range(4))
    loading.load = Future()
    reasons = reasons_of(parts, registry_pending={2}, halted={1: "group g: device"})
    assert reasons == {0: {LOADING}, 1: {HALTED}, 2: {REGISTRY}, 3: frozenset()}
    everywhere = reasons_of(parts, backpressure=True, stopping=True)
    assert all(why >= {BACKPRESSURE, SHUTDOWN} for why in everywhere.values())


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
    assert resolver.pending == {0, 2}
    _wait(resolver, lambda r: resolver.unavailable)
    assert "ConnectionError" in resolver.last_error
    released = _wait(resolver, lambda r: r == {0, 2})
    assert released == {0, 2} and codec.calls == 4 and not resolver.unavailable
    assert resolver.pending == frozenset()
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
