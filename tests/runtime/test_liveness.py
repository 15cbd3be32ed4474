"""A silent network partition (connections open, nothing answered) is an outage within seconds,
not once librdkafka's socket timeout (60 s) closes the connections or never (a partition that
heals first): stage.runtime.kafka.liveness asks the brokers every second. One broker of several
answering is not an outage. Also: a transaction whose records go unacknowledged makes readiness
false, and the log never says a fenced transaction was aborted when its commit may have landed.
No broker: the requests are fakes, the times scaled down."""

import logging
import threading
import time
from types import SimpleNamespace

from confluent_kafka import TopicPartition

from stage.config.model import StageConfig
from stage.publish.outputs import Outputs
from stage.publish.transaction import COMMIT, FLUSH
from stage.runtime.kafka.health import BrokerHealth
from stage.runtime.kafka.ledger import LedgerState
from stage.runtime.kafka.liveness import BrokerLiveness
from stage.runtime.loop import StageRuntime
from tests.runtime.fakes import Consumer, NeverLoads, Publisher, Workers, connect

SILENT_S = 0.3


class Brokers:
    """``ask`` as the liveness calls it: held (no answer until the timeout), or answering."""

    def __init__(self, answer_every: int = 0):
        """``answer_every``: while held, every n-th request is answered anyway (0: none)."""
        self.held = threading.Event()
        self.answer_every, self.asked = answer_every, 0

    def __call__(self, timeout_s):
        self.asked += 1
        if self.held.is_set() and not (self.answer_every and self.asked % self.answer_every == 0):
            time.sleep(timeout_s)
            raise TimeoutError("metadata request timed out")


def _liveness(brokers, health):
    return BrokerLiveness(brokers, health, every_s=0.02, silent_after_s=SILENT_S).start()


def _within(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_brokers_that_stop_answering_are_an_outage_and_answering_ones_are_not():
    health, brokers = BrokerHealth(), Brokers()
    liveness = _liveness(brokers, health)
    try:
        assert not _within(lambda: health.down() is not None, 4 * SILENT_S)   # answering: no outage
        brokers.held.set()
        assert _within(lambda: health.down() is not None)
        assert "no broker answered a metadata request" in health.describe()
        assert "TimeoutError" in health.describe()
    finally:
        liveness.stop()


def test_one_broker_of_three_cut_off_is_not_an_outage():
    health, brokers = BrokerHealth(), Brokers(answer_every=3)   # two requests of three unanswered
    brokers.held.set()
    liveness = _liveness(brokers, health)
    try:
        assert not _within(lambda: health.down() is not None, 6 * SILENT_S)
        assert brokers.asked > 6
    finally:
        liveness.stop()


def test_after_an_outage_ends_silence_is_counted_afresh():
    health, brokers = BrokerHealth(), Brokers()
    brokers.held.set()
    liveness = _liveness(brokers, health)
    try:
        assert _within(lambda: health.down() is not None)
        brokers.held.clear()
        health.recovered(health.outage)                  # what a new producer initialized does
        assert not _within(lambda: health.down() is not None, 4 * SILENT_S)
        brokers.held.set()                               # a second partition: a second outage
        assert _within(lambda: health.down() is not None) and health.outage == 2
    finally:
        liveness.stop()


def _stats(*rxidle_s):
    """Consumer statistics: one connected broker per value, last heard from that long ago."""
    import json
    return json.dumps({"brokers": {f"b{i}": {"state": "UP", "source": "learned", "rxidle": int(idle * 1e6)}
                                   for i, idle in enumerate(rxidle_s)}})


def test_a_consumer_that_still_hears_from_a_broker_is_not_cut_off():
    """The metadata requests may all go to the one broker cut off; the consumer's fetches from
    the others say the replica is not."""
    health, brokers = BrokerHealth(), Brokers()
    brokers.held.set()
    liveness = _liveness(brokers, health)
    try:
        deadline = time.monotonic() + 6 * SILENT_S
        while time.monotonic() < deadline:
            liveness.consumer_stats(_stats(60.0, 0.01))     # one broker silent, one answering
            assert health.down() is None
            time.sleep(0.02)
        liveness.consumer_stats(_stats(60.0, 60.0))         # none answers the consumer either
        assert _within(lambda: health.down() is not None)
        assert "nor any broker the consumer" in health.describe()
    finally:
        liveness.stop()


def test_the_consumer_reads_its_statistics_every_second_and_lag_at_its_own_interval():
    rt = _runtime()
    try:
        conf = rt._consumer_config()
        assert conf["statistics.interval.ms"] == 1000 and conf["stats_cb"] == rt._on_statistics
        rt.cfg = rt.cfg.model_copy(update={"statistics_interval_ms": 200})   # lag more often than that
        assert rt._consumer_config()["statistics.interval.ms"] == 200
        rt.cfg = rt.cfg.model_copy(update={"statistics_interval_ms": 5000})
        seen = []
        rt.liveness = SimpleNamespace(consumer_stats=seen.append)
        rt.stats.sink.librdkafka_stats = lambda s: seen.append(("lag", s))
        rt._on_statistics("{}")
        rt._on_statistics("{}")                               # within statistics_interval_ms
        assert seen == ["{}", ("lag", "{}"), "{}"]
    finally:
        rt.flight.close()
        rt.publish_pool.shutdown(wait=False)


def _runtime():
    rt = StageRuntime(StageConfig(bootstrap_servers="127.0.0.1:1", publish_linger_ms=0))
    rt.pool.shutdown(wait=False)
    rt.loader_pool.shutdown(wait=False)
    rt.finalization.workers = Workers()
    rt.loads.pool = NeverLoads()
    return rt


def _ready(rt, consumer, *numbers):
    rt._on_assign(consumer, [TopicPartition(rt.cfg.topics.receipts, p) for p in numbers])
    for p in numbers:
        rt.partitions.get(p).load.set_result(LedgerState())
    rt.step()
    assert rt.readiness()[0], rt.readiness()


def _until(rt, predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rt.step()
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"not reached; readiness {rt.readiness()}")


def test_a_silent_partition_makes_the_replica_unready_and_a_new_producer_makes_it_ready():
    rt, consumer, brokers = _runtime(), Consumer(), Brokers()
    connect(rt, consumer)
    made = []
    rt.flight.new_publisher = lambda: made.append(Publisher()) or made[-1]
    rt.liveness = _liveness(brokers, rt.broker_health)
    try:
        _ready(rt, consumer, 0)
        brokers.held.set()
        _until(rt, lambda: "no broker answered" in rt.readiness()[1])
        brokers.held.clear()
        _until(rt, lambda: rt.readiness()[0])           # ready again: a new producer initialized
        assert made and rt.flight.publisher is made[-1]
    finally:
        rt.liveness.stop()
        rt.flight.close()
        rt.publish_pool.shutdown(wait=False)


class Held(Publisher):
    """A publication stuck in ``phase`` with ``held`` records unacknowledged."""

    def __init__(self, phase):
        super().__init__()
        self.phase, self.phase_since = phase, time.monotonic()
        self.held, self.release = 3, threading.Event()

    def outstanding(self):
        return self.held

    def publish(self, batch, consumer):
        self.release.wait(30)


def _in_flight(rt, consumer, publisher):
    connect(rt, consumer)
    rt.flight.publisher = publisher
    _ready(rt, consumer, 0)
    epoch = rt.partitions.get(0).epoch
    rt.publication.offer([Outputs(0, "g7", epoch, SimpleNamespace(last_timestamp_ms=0), ledger_value=b"e")])
    _until(rt, lambda: rt.flight.in_flight)


def test_records_unacknowledged_make_readiness_false_until_acknowledgements_move(monkeypatch):
    import stage.runtime.steps.flight as flight

    monkeypatch.setattr(flight, "_UNANSWERED_S", SILENT_S)
    rt, held = _runtime(), Held(FLUSH)
    try:
        _in_flight(rt, Consumer(), held)
        _until(rt, lambda: "3 records unacknowledged" in rt.readiness()[1])
        held.held = 1                                      # an acknowledgement came
        assert rt.readiness()[0], rt.readiness()
        assert rt.flight.in_flight and rt.flight.replacing is None   # never a reason to fence
    finally:
        held.release.set()
        rt.flight.close()
        rt.publish_pool.shutdown(wait=False)


def test_a_fence_during_a_commit_is_not_logged_as_an_abort(caplog):
    rt, held = _runtime(), Held(COMMIT)
    rt.flight.new_publisher = Publisher
    try:
        _in_flight(rt, Consumer(), held)
        caplog.set_level(logging.WARNING, logger="stage.runtime.loop")
        rt.broker_health.unreachable("test: the coordinator's answer is withheld")
        _until(rt, lambda: not rt.flight.in_flight)        # fenced, rewound
        assert ("the transaction in flight, in commit_transaction, is committed if its commit reaches "
                "the transaction coordinator before the fence, else the fence aborts it") in caplog.text
        assert "its open transaction is aborted" not in caplog.text     # what it said before
    finally:
        held.release.set()
        rt.flight.close()
        rt.publish_pool.shutdown(wait=False)
