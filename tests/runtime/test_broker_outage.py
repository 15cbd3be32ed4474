"""The brokers going away and coming back, as the runtime sees it, with fakes (no broker): the
consumer's error callback saying every broker is down makes readiness false at once and opens
no transaction; a new producer, started at once and retried for as long as the brokers do not
answer, fences the old one; the stage is ready again only once it is initialized. A transaction
cut short by it rewinds the stage, and the log says how it ended once the ledger is read again.
"""

import logging
import threading
import time
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, TopicPartition

from stage.config.model import StageConfig
from stage.publish.outputs import Outputs
from stage.publish.transaction import SEND_OFFSETS
from stage.runtime.kafka.ledger import LedgerState
from stage.runtime.loop import StageRuntime
from tests.runtime.fakes import Consumer, Message, NeverLoads, Publisher, Workers, connect


@pytest.fixture
def rt():
    runtime = StageRuntime(StageConfig(bootstrap_servers="127.0.0.1:1", publish_linger_ms=0))
    runtime.pool.shutdown(wait=False)
    runtime.loader_pool.shutdown(wait=False)
    runtime.finalization.workers = Workers()
    runtime.loads.pool = NeverLoads()
    yield runtime
    runtime.flight.close()
    runtime.publish_pool.shutdown(wait=False)


def _ready(rt, consumer, *numbers):
    rt._on_assign(consumer, [TopicPartition(rt.cfg.topics.receipts, p) for p in numbers])
    for p in numbers:
        rt.partitions.get(p).load.set_result(LedgerState())
    rt.step()
    assert rt.readiness()[0], rt.readiness()


def _brokers_down(rt):
    """What librdkafka tells the consumer's error_cb when its last broker connection fails."""
    rt._consumer_config()["error_cb"](KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))


def _steps(rt, seconds=0.3):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rt.step()
        time.sleep(0.01)


def _until(rt, predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rt.step()
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("not reached")


class Back:
    """A new_publisher that cannot start until the brokers are back (``back.set()``)."""

    def __init__(self):
        self.back, self.made, self.attempts = threading.Event(), [], 0

    def __call__(self):
        self.attempts += 1
        if not self.back.wait(0.05):
            from confluent_kafka import KafkaException
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "no broker answers", retriable=True))
        self.made.append(Publisher())
        return self.made[-1]


def test_readiness_is_false_while_the_brokers_are_away_and_true_once_a_new_producer_is_ready(rt):
    consumer = Consumer()
    connect(rt, consumer)
    old = rt.flight.publisher
    rt.flight.new_publisher = back = Back()
    _ready(rt, consumer, 0, 1)

    _brokers_down(rt)
    ready, why = rt.readiness()
    assert not ready and "brokers unreachable" in why
    consumer.batches = [[Message(rt.cfg.topics.receipts, 1, 0, b"g", b"garbage")]]   # a dead letter
    _until(rt, lambda: back.attempts >= 3)                   # the new producer is retried meanwhile
    assert not rt.readiness()[0] and old.batches == [] and not rt.flight.in_flight   # nothing opened

    back.back.set()
    _until(rt, lambda: back.made and back.made[0].batches)
    assert rt.flight.publisher is back.made[0] and old.batches == []
    assert rt.readiness()[0], rt.readiness()
    assert not [c for c in consumer.calls if c[0] == "seek"]   # no transaction was open: no rewind


class Stuck(Publisher):
    """A publication that never comes back from send_offsets_to_transaction."""

    phase = SEND_OFFSETS

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.phase_since = time.monotonic()

    def publish(self, batch, consumer):
        self.release.wait(30)
        raise RuntimeError("fenced")


@pytest.mark.parametrize("committed", [True, False])
def test_a_transaction_cut_short_rewinds_and_the_log_says_how_it_ended(rt, caplog, committed):
    consumer = Consumer()
    connect(rt, consumer)
    rt.flight.publisher = stuck = Stuck()
    rt.flight.new_publisher = back = Back()
    _ready(rt, consumer, 0)
    epoch = rt.partitions.get(0).epoch
    rt.publication.offer([Outputs(0, "g7", epoch, SimpleNamespace(last_timestamp_ms=0), ledger_value=b"e")])
    _until(rt, lambda: rt.flight.in_flight)
    try:
        _brokers_down(rt)
        _steps(rt)
        assert "brokers unreachable" in rt.readiness()[1]
        back.back.set()
        caplog.set_level(logging.INFO, logger="stage.runtime.loop")
        _until(rt, lambda: rt.flight.publisher is not stuck)
        assert rt.loads.loading == [0] and not rt.flight.in_flight       # rewound: the ledger reloads
        assert ("seek", rt.cfg.topics.receipts, 0, 0) in consumer.calls
        assert "was committed if its commit had reached the coordinator" in caplog.text
        entry = {"max_receipt_offset": 3, "max_staged_offset": 5, "published_at_ms": 1}
        rt.partitions.get(0).load.set_result(LedgerState(groups={"g7": entry} if committed else {}))
        rt.step()
        outcome = "committed" if committed else "aborted"
        assert f"partition 0: the transaction cut short was {outcome}: its groups ['g7']" in caplog.text
        assert rt.readiness()[0], rt.readiness()
    finally:
        stuck.release.set()


class Broken:
    """A producer whose fatal error (fenced, or its transaction aborted by the brokers) makes
    flush raise, as librdkafka's does."""

    def flush(self, timeout=None):
        from confluent_kafka import KafkaException
        raise KafkaException(KafkaError(KafkaError._FENCED, "This instance has been fenced", fatal=True))


def test_closing_a_fatally_failed_producer_never_hides_why_the_stage_stops(rt):
    from stage.publish import TransactionalPublisher
    from stage.runtime import exits

    TransactionalPublisher(Broken()).close()          # logged, not raised
    consumer = Consumer()
    connect(rt, consumer)
    rt.flight.publisher = TransactionalPublisher(Broken())
    rt._fatal = exits.kafka_fatal("fatal producer error: the real one")
    rt.shutdown()                                      # the caller raises rt._fatal, not flush's error


def test_every_client_tries_a_returning_broker_at_least_once_a_second():
    """librdkafka's reconnect back-off grows to reconnect.backoff.max.ms (10 s by default): a
    broker back after a restart would be found up to 10 s late by each client."""
    from stage.runtime.kafka.clients import consumer_config, producer_config, reader_config

    cfg = StageConfig()
    for conf in (consumer_config(cfg), producer_config(cfg), reader_config(cfg, "ledger")):
        assert conf["reconnect.backoff.max.ms"] <= 1000
    assert consumer_config(StageConfig(kafka={"reconnect.backoff.max.ms": 5000}))["reconnect.backoff.max.ms"] == 5000
