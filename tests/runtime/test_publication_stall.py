"""A publication that never returns from the Kafka client (librdkafka #5511: send_offsets_to_
transaction after a broker restart) stops the stage with exit 8 once the transaction is past its
timeout, without waiting for the stuck thread; a slow one that finishes in time lands normally.
No broker: the runtime is built but never started."""

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from stage.runtime.steps import flight
from stage.runtime.exits import EXIT_KAFKA_FATAL, StageExit
from stage.publish import Batch
from stage.config.model import StageConfig
from stage.runtime.loop import StageRuntime


@pytest.fixture
def runtime(monkeypatch):
    monkeypatch.setattr(flight, "_ABORT_SWEEP_S", 0.0)
    rt = StageRuntime(StageConfig(bootstrap_servers="127.0.0.1:1", transaction_timeout_ms=1000))
    yield rt
    rt.pool.shutdown(wait=False)
    rt.loader_pool.shutdown(wait=False)
    rt.publish_pool.shutdown(wait=False)


def _in_flight(rt, started_ago: float) -> Future:
    future = Future()
    rt.flight.current = (future, [], Batch(offsets=[object()]))
    rt.flight.started_at = time.monotonic() - started_ago
    return future


def test_a_publication_past_the_transaction_timeout_stops_the_stage(runtime):
    _in_flight(runtime, 0.2)
    runtime._publish()                                  # young: the loop goes on
    assert runtime._fatal is None
    runtime.flight.started_at -= 1.0                    # now past transaction_timeout_ms
    with pytest.raises(StageExit) as stop:
        runtime._publish()
    assert stop.value.code == EXIT_KAFKA_FATAL and stop.value.abandon_threads
    assert "has not completed in 1s" in str(stop.value) and "#5511" in str(stop.value)
    assert runtime._fatal is stop.value                 # shutdown skips publishing and joining


def test_a_forced_publish_waits_only_until_the_limit(runtime):
    future = _in_flight(runtime, 0.5)
    runtime.flight.publisher = SimpleNamespace(commit_offsets=lambda batch, consumer: None)
    threading.Timer(5.0, future.set_result, args=(5.0,)).start()   # a waiter without a limit fails
    started = time.monotonic()
    with pytest.raises(StageExit):
        runtime._publish(force=True)                    # shutdown or revoke: bounded wait
    assert time.monotonic() - started < 2.0


def test_a_slow_publication_that_finishes_in_time_lands(runtime, monkeypatch):
    future = _in_flight(runtime, 0.0)
    landed = []
    runtime.flight.publisher = SimpleNamespace(commit_offsets=lambda batch, consumer: None)
    monkeypatch.setattr(runtime.publication, "_remember_committed", lambda offsets: landed.append(offsets))
    threading.Timer(0.3, future.set_result, args=(0.3,)).start()
    monkeypatch.setattr(runtime.publication, "_next_batch", lambda consumer, force: None)
    runtime._publish(force=True)
    assert runtime._fatal is None and runtime.flight.current is None and len(landed) == 1


def test_a_revoke_after_the_stall_lets_the_partitions_go_without_publishing(runtime):
    """consumer.close() in shutdown revokes: it must not wait on the stuck call again."""
    from confluent_kafka import TopicPartition

    _in_flight(runtime, 2.0)
    with pytest.raises(StageExit):
        runtime._publish()
    unassigned = []
    consumer = SimpleNamespace(incremental_unassign=unassigned.extend)
    runtime._on_revoke(consumer, [TopicPartition(runtime.cfg.topics.receipts, 0)])
    assert [(tp.topic, tp.partition) for tp in unassigned] == [
        (runtime.cfg.topics.receipts, 0), (runtime.cfg.topics.staged_calls, 0)]
