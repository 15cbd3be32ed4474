"""A publication stuck in a coordinator call (librdkafka #5511) is recovered in process: past
publish_stuck_ms readiness says so, a new publisher is started off the loop thread, the stuck
call is abandoned and the stage rewinds; a slow produce is not mistaken for a stuck call. No
broker: the publication step with fakes."""

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from stage.config.model import StageConfig
from stage.publish import Batch
from stage.publish.transaction import FLUSH, SEND_OFFSETS
from stage.runtime.detached import DetachedWorker
from stage.runtime.exits import StageExit
from stage.runtime.state.partition import Partitions
from stage.runtime.stats import RuntimeStats
from stage.runtime.steps import flight as flight_module
from stage.runtime.steps.flight import Flight
from stage.runtime.steps.outcomes import Rewind
from stage.runtime.steps.publication import Publication


class Stats(RuntimeStats):
    def __init__(self):
        super().__init__(sink=SimpleNamespace(inc=lambda *a: None, set=lambda *a: None,
                                              observe=lambda *a: None))


class Recorder:
    """The publish step as the loop drives it: a Rewind it raises is recorded."""

    def __init__(self, pub):
        self.pub, self.rewinds = pub, []

    def publish(self, force=False):
        try:
            self.pub.publish(consumer=None, force=force)
        except Rewind:
            self.rewinds.append(1)


def _publication(stuck_ms=1000, new_publisher=None, transaction_timeout_ms=60_000):
    cfg = StageConfig(bootstrap_servers="127.0.0.1:1", publish_stuck_ms=stuck_ms,
                      transaction_timeout_ms=transaction_timeout_ms)
    flight = Flight(cfg, pool=DetachedWorker("test-publish"), stats=Stats(), new_publisher=new_publisher)
    flight.publisher = SimpleNamespace(phase=FLUSH, phase_since=time.monotonic(), close=lambda **k: None)
    pub = Publication(cfg, flight=flight, ledger_codec=None, clock=None, partitions=Partitions(),
                      stats=flight.stats)
    return Recorder(pub), flight


def _stuck_flight(flight, phase, seconds_ago):
    future = Future()
    flight.current = (future, [], Batch(offsets=[object()]))
    flight.started_at = time.monotonic() - seconds_ago
    flight.publisher.phase, flight.publisher.phase_since = phase, time.monotonic() - seconds_ago
    return future


def _until(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def test_a_stuck_coordinator_call_is_fenced_by_a_new_publisher_and_the_stage_rewinds():
    replacement = SimpleNamespace(phase="idle", phase_since=time.monotonic())
    started = threading.Event()

    def new_publisher():
        started.set()
        return replacement

    pub, flight = _publication(new_publisher=new_publisher)
    stuck = flight.publisher
    _stuck_flight(flight, SEND_OFFSETS, 2.0)
    assert "publication stuck in send_offsets_to_transaction" in flight.stuck()
    pub.publish()                                   # starts the replacement off the loop thread
    assert started.wait(5) and "replacing the producer" in flight.stuck()
    _until(lambda: flight.replacing.done())
    pub.publish()                                   # lands the replacement
    assert flight.publisher is replacement and flight.abandoned == [stuck]
    assert flight.current is None and pub.rewinds == [1] and flight.pool.abandoned == 1
    assert flight.stuck() is None and flight.stats.total("publication_recoveries") == 1


def test_a_slow_flush_is_not_a_stuck_call():
    pub, flight = _publication(new_publisher=lambda: pytest.fail("must not replace"))
    _stuck_flight(flight, FLUSH, 5.0)               # producing a large batch for 5 s
    pub.publish()
    assert flight.stuck() is None and flight.replacing is None and pub.rewinds == []


def test_a_forced_publish_recovers_a_stuck_flight_instead_of_waiting_out_the_timeout():
    pub, flight = _publication(new_publisher=lambda: SimpleNamespace(phase="idle", phase_since=0))
    _stuck_flight(flight, SEND_OFFSETS, 2.0)
    began = time.monotonic()
    pub.publish(force=True)                         # a revoke or shutdown
    assert time.monotonic() - began < 5 and flight.current is None and pub.rewinds == [1]


def test_without_a_replacement_the_stage_stops_at_the_stall_deadline(monkeypatch):
    monkeypatch.setattr(flight_module, "_ABORT_SWEEP_S", 0.0)

    def never_ready():
        from confluent_kafka import KafkaError, KafkaException
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "brokers down", retriable=True))

    pub, flight = _publication(new_publisher=never_ready, transaction_timeout_ms=1000)
    _stuck_flight(flight, SEND_OFFSETS, 0.5)
    with pytest.raises(StageExit) as stop:
        pub.publish(force=True)
    assert stop.value.abandon_threads and "#5511" in str(stop.value) and pub.rewinds == []


def _retriable_until(ready: threading.Event):
    """A new_publisher that cannot start (the brokers do not answer) until ``ready`` is set."""
    from confluent_kafka import KafkaError, KafkaException

    def new_publisher():
        if not ready.is_set():
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "brokers down", retriable=True))
        return SimpleNamespace(phase="idle", phase_since=time.monotonic(), close=lambda **k: None)
    return new_publisher


def test_a_running_stage_waits_for_the_brokers_past_the_stall_deadline_instead_of_exiting(monkeypatch):
    """An outage longer than the transaction timeout: the replacement keeps trying, readiness
    stays false, and once a new producer starts the stage rewinds; it never stops by itself."""
    monkeypatch.setattr(flight_module, "_ABORT_SWEEP_S", 0.0)
    ready = threading.Event()
    pub, flight = _publication(new_publisher=_retriable_until(ready), transaction_timeout_ms=1000)
    _stuck_flight(flight, SEND_OFFSETS, 1.5)         # past publish_stuck_ms (1 s): replaced
    deadline = time.monotonic() + 2.5                 # and past the stall deadline (1 s + 0)
    while time.monotonic() < deadline:
        pub.publish()                                 # the loop goes on: no StageExit
        assert "replacing the producer" in flight.stuck()
        time.sleep(0.05)
    ready.set()
    _until(lambda: flight.replacing.done())
    pub.publish()
    assert pub.rewinds == [1] and flight.current is None


def test_a_transaction_aborted_by_the_brokers_after_an_outage_is_not_a_second_process(monkeypatch):
    """The brokers abort a transaction that outlived transaction_timeout_ms and bump the
    producer's epoch: librdkafka calls that fenced (fatal). Not exit 6: a new producer and a
    rewind. A fence of a young transaction (another process with this id) still stops."""
    from stage.publish import StageFatal

    ready = threading.Event()
    ready.set()
    pub, flight = _publication(new_publisher=_retriable_until(ready), transaction_timeout_ms=1000)
    future = _stuck_flight(flight, SEND_OFFSETS, 1.5)  # it outlived the transaction timeout
    future.set_exception(StageFatal("fatal producer error: Local: This instance has been fenced"))
    pub.publish()                                      # starts a replacement instead of landing it
    _until(lambda: flight.replacing is not None and flight.replacing.done())
    pub.publish()
    assert pub.rewinds == [1] and flight.current is None

    young = _stuck_flight(flight, SEND_OFFSETS, 0.0)
    young.set_exception(StageFatal("fatal producer error: Local: This instance has been fenced"))
    with pytest.raises(StageExit) as stop:
        pub.publish()
    assert stop.value.code == 6
