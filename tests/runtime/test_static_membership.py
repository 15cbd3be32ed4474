"""Static group membership by default (``static_membership``): the consumer's group.instance.id
is the transactional id, so a replica whose session expired while the brokers were away takes
its place back at once instead of waiting out its old session; it still leaves the group on a
graceful shutdown (librdkafka sends a static member's LeaveGroup only on unsubscribe), unless
the operator set group.instance.id (Kafka's own static behaviour). Two members with one id:
the consumer is fenced, exit 6. No broker."""

import pytest
from confluent_kafka import KafkaError, TopicPartition

from stage.config.model import StageConfig
from stage.runtime.exits import EXIT_KAFKA_FATAL, StageExit
from stage.runtime.kafka.clients import consumer_config
from stage.runtime.kafka.ledger import LedgerState
from stage.runtime.loop import StageRuntime
from tests.runtime.fakes import Consumer, NeverLoads, Workers, connect


def test_the_consumer_is_a_static_member_named_by_the_transactional_id():
    cfg = StageConfig(transactional_id="rr-0")
    assert consumer_config(cfg)["group.instance.id"] == "rr-0"
    assert consumer_config(StageConfig(transactional_id="a/b:c"))["group.instance.id"] == "a_b_c"
    assert "group.instance.id" not in consumer_config(StageConfig(transactional_id="rr-0",
                                                                  static_membership=False))
    chart = StageConfig(transactional_id="rr-0", consumer={"group.instance.id": "pod-0"})
    assert consumer_config(chart)["group.instance.id"] == "pod-0"


class Leaving(Consumer):
    """Records unsubscribe and close; an unsubscribe revokes the assignment at the next poll."""

    def __init__(self, runtime):
        super().__init__()
        self.runtime, self.order, self._revoke = runtime, [], False

    def unsubscribe(self):
        self.order.append("unsubscribe")
        self._revoke = True

    def poll(self, timeout=None):
        if self._revoke:
            self._revoke = False
            numbers = self.runtime.partitions.numbers()
            self.runtime._on_revoke(self, [TopicPartition(self.runtime.cfg.topics.receipts, p) for p in numbers])
        return None

    def close(self):
        self.order.append("close")


def _runtime(**settings):
    runtime = StageRuntime(StageConfig(bootstrap_servers="127.0.0.1:1", transactional_id="rr-0", **settings))
    runtime.pool.shutdown(wait=False)
    runtime.loader_pool.shutdown(wait=False)
    runtime.finalization.workers = Workers()
    runtime.loads.pool = NeverLoads()
    return runtime


@pytest.mark.parametrize("settings, leaves", [({}, True),
                                              ({"consumer": {"group.instance.id": "pod-0"}}, False),
                                              ({"static_membership": False}, False)])
def test_a_graceful_shutdown_leaves_the_group_unless_the_operator_chose_kafkas_static_behaviour(settings, leaves):
    rt = _runtime(**settings)
    consumer = Leaving(rt)
    connect(rt, consumer)
    rt._on_assign(consumer, [TopicPartition(rt.cfg.topics.receipts, 0)])
    rt.partitions.get(0).load.set_result(LedgerState())
    rt.step()
    rt.shutdown()
    assert consumer.order == (["unsubscribe", "close"] if leaves else ["close"])
    assert not consumer.assigned if leaves else True


class Failed:
    def __init__(self, error: KafkaError) -> None:
        self._error = error

    def error(self):
        return self._error


FENCED_TEXT = "Broker: Static consumer fenced by other consumer with same group.instance.id"


@pytest.mark.parametrize("error", [
    KafkaError(KafkaError.FENCED_INSTANCE_ID, FENCED_TEXT, fatal=True),
    # what librdkafka 2.16 hands the application (the soak: a JoinGroup delivered late after a
    # silent partition): code _FATAL, fatal() false, the cause in the text
    KafkaError(KafkaError._FATAL, f"Fatal error: {FENCED_TEXT}: Fatal consumer error: {FENCED_TEXT}"),
], ids=["fenced-instance-id", "librdkafka-fatal-event"])
def test_a_fenced_instance_id_drops_the_partitions_as_lost_and_joins_again_with_a_new_consumer(error):
    """librdkafka's consumer cannot go on once fenced; the stage neither exits (a network
    partition must not stop a replica) nor goes on with it (it would fetch nothing, for ever)."""
    rt = _runtime()
    fenced, fresh = Consumer(), Consumer()
    connect(rt, fenced)
    rt._on_assign(fenced, [TopicPartition(rt.cfg.topics.receipts, 0)])
    rt.partitions.get(0).load.set_result(LedgerState())
    rt.step()
    assert rt.partitions.numbers() == [0]
    rt._new_consumer = lambda: fresh
    fenced.batches = [[Failed(error)]]
    rt.step()                                      # no StageExit
    assert rt.clients.consumer is fresh and rt.partitions.numbers() == []
    assert rt._fenced_consumers == [fenced]       # kept (a transaction in flight may hold it)
    rt._on_assign(fresh, [TopicPartition(rt.cfg.topics.receipts, 0)])   # the new member's share
    rt.partitions.get(0).load.set_result(LedgerState())
    rt.step()
    assert rt.partitions.get(0).buffer is not None
    assert (rt.cfg.topics.receipts, 0) in fresh.assigned
    rt.publish_pool.shutdown(wait=False)


def test_any_other_fatal_consumer_event_stops_the_stage_with_exit_8_not_a_warning():
    """A consumer in librdkafka's fatal state fetches nothing more: going on would leave a
    process that is alive, holds no partition and never exits."""
    rt = _runtime()
    consumer = Consumer()
    connect(rt, consumer)
    consumer.batches = [[Failed(KafkaError(KafkaError._FATAL, "Fatal error: Broker: something else"))]]
    with pytest.raises(StageExit) as stop:
        rt.step()
    assert stop.value.code == EXIT_KAFKA_FATAL and "something else" in str(stop.value)
    rt.publish_pool.shutdown(wait=False)
