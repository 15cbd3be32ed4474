"""One iteration of the runtime with fakes (tests/runtime/fakes.py), no broker: the steps' work
is handed on through the runtime, the pause reasons and the gauges are derived from the state
each iteration (a rewind that clears a halt clears the halted_partitions gauge), and a
partition that leaves takes its share of every step's work with it."""

import time
from types import SimpleNamespace

import pytest
from confluent_kafka import TopicPartition

from stage.config.model import StageConfig
from stage.publish import PublishAborted
from stage.publish.deadletters import DEAD_LETTER_WATERMARK_KEY
from stage.publish.outputs import Outputs
from stage.runtime.kafka.ledger import LedgerState
from stage.runtime.loop import StageRuntime
from stage.runtime.state.pauses import HALTED, LOADING
from stage.runtime.steps.deadlines import Ready
from tests.runtime.fakes import Consumer, Message, NeverLoads, Workers, connect


@pytest.fixture
def rt():
    runtime = StageRuntime(StageConfig(bootstrap_servers="127.0.0.1:1", publish_linger_ms=0))
    runtime.pool.shutdown(wait=False)
    runtime.loader_pool.shutdown(wait=False)
    runtime.finalization.workers = Workers()
    runtime.loads.pool = NeverLoads()
    yield runtime
    runtime.publish_pool.shutdown(wait=False)


def _assign(rt, consumer, *numbers):
    rt._on_assign(consumer, [TopicPartition(rt.cfg.topics.receipts, p) for p in numbers])


def _load(rt, *numbers, ledger=None):
    for p in numbers:
        rt.partitions.get(p).load.set_result(ledger or LedgerState())


def _until(rt, predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rt.step()
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("not reached")


def _group(rt, p, group_id="g"):
    return Ready(SimpleNamespace(group_id=group_id, partition=p, nbytes=10), "complete",
                 rt.partitions.get(p).epoch)


def _halt(rt, p):
    work = _group(rt, p)
    rt.finalization.offer([work])
    rt.step()
    rt.finalization.workers.futures["g"].set_result(Outputs(
        p, "g", work.epoch, None, error="finalize_error: device: RuntimeError: CUDA error"))
    rt.step()


def test_the_halted_partitions_gauge_follows_a_rewind(rt):
    consumer = Consumer()
    connect(rt, consumer)
    _assign(rt, consumer, 0, 1)
    _load(rt, 0, 1)
    rt.step()
    _halt(rt, 0)
    assert rt.halted and rt.stats.gauges["halted_partitions"] == 1
    assert rt.pauses.why(0) == {HALTED} and (rt.cfg.topics.staged_calls, 0) in consumer.paused
    rt.flight.publisher.fail = PublishAborted("the transaction was aborted")
    consumer.batches = [[Message(rt.cfg.topics.receipts, 1, 0, b"g", b"garbage")]]  # a dead letter to publish
    _until(rt, lambda: rt.stats.total("transactions_aborted") == 1)
    assert rt.halted == {} and rt.stats.gauges["halted_partitions"] == 0
    assert rt.pauses.why(0) == {LOADING} and rt.readiness()[0] is False     # reloading its ledger
    assert ("seek", rt.cfg.topics.receipts, 0, 0) in consumer.calls


def test_a_dead_letter_is_published_with_the_watermark_it_carries(rt):
    consumer = Consumer()
    connect(rt, consumer)
    _assign(rt, consumer, 1)
    _load(rt, 1, ledger=LedgerState(dead_letter_offsets={"receipts": 3, "staged_calls": 9}))
    rt.step()
    topic = rt.cfg.topics.receipts
    consumer.batches = [[Message(topic, 1, 2, b"g", b"garbage"), Message(topic, 1, 5, b"g", b"garbage")]]
    _until(rt, lambda: rt.flight.publisher.batches)
    [batch] = rt.flight.publisher.batches
    letters = [r for r in batch.records if r[0] == rt.cfg.topics.dead_letter]
    [mark] = [r for r in batch.records if r[2] == DEAD_LETTER_WATERMARK_KEY]
    entry = rt.codecs["LedgerEntry"].decode(mark[3])
    assert len(letters) == 1                      # offset 2 was dead-lettered before the restart
    assert (entry["max_receipt_offset"], entry["max_staged_offset"]) == (5, 9)
    assert rt.stats.count("records_skipped", topic=topic, reason="dead_lettered_before") == 1


def test_a_revoked_partition_takes_its_share_of_every_steps_work_with_it(rt):
    consumer = Consumer()
    connect(rt, consumer)
    _assign(rt, consumer, 0, 1, 2)
    _load(rt, 0, 1, 2)
    rt.step()
    _halt(rt, 2)
    rt.finalization.max_inflight = 0               # nothing more starts: the groups wait
    rt.finalization.offer([_group(rt, 0, "a"), _group(rt, 1, "b")])
    rt.deadlines.held[0] = "receipts[0] (no leader)"
    rt._on_revoke(consumer, [TopicPartition(rt.cfg.topics.receipts, p) for p in (0, 2)])
    assert rt.partitions.numbers() == [1] and rt.halted == {} and rt.deadlines.held == {}
    assert [w.group.group_id for w in rt.finalization.waiting.items()] == ["b"]
    assert consumer.assigned == {(t, 1) for t in rt.topics} and not consumer.paused
    assert rt.stats.gauges["assigned_partitions"] == 2 and rt.stats.gauges["halted_partitions"] == 0
