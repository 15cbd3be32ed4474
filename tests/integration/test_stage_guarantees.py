"""Guarantees beyond the happy path, on the real broker: 50 groups in direct and deferred mode,
abort-and-rewind after a failed transaction, at-least-once mode, and back-pressure."""

import pytest

from stage.finalize import ReassemblyConfig
from stage.runtime.state.pauses import BACKPRESSURE
from stage.publish import PublishAborted
from stage.wire import AvroCodec
from tests.integration.harness import (
    Feeder, RunningStage, expected_rows, make_group, read_all, rows_by_group, setup_topics, stage_config,
    unique_topics,
)

ROWS, SUMMARY, PLANS = AvroCodec("CanonicalRow"), AvroCodec("GroupSummary"), AvroCodec("RoutePlan")


def _run(kafka, groups, **overrides):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, **overrides)
    setup_topics(cfg, partitions=2)
    feed = Feeder(kafka.bootstrap, topics)
    for spec in groups:
        feed.staged(spec)
        feed.receipts(spec)
    feed.flush()
    return cfg, topics


def _outputs(kafka, topics):
    rows = [ROWS.decode(m.value()) for m in read_all(kafka.bootstrap, topics.canonical_rows)]
    summaries = [SUMMARY.decode(m.value()) for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    return rows, summaries


def _assert_exactly_once(rows, summaries, groups, finalize):
    assert sorted(s["group_id"] for s in summaries) == sorted(g.group_id for g in groups)
    assert len({r["sample_id"] for r in rows}) == len(rows)
    by_group = rows_by_group(rows)
    for spec in groups:
        got = by_group[spec.group_id]
        assert got == expected_rows(spec, finalize)


@pytest.mark.parametrize("mode", ["direct", "deferred"])
def test_fifty_groups_with_routes_publish_exactly_n_rows_equal_to_the_library(kafka, mode):
    finalize = ReassemblyConfig(router_replay=True, defer_routes=mode == "deferred")
    groups = [make_group(f"{mode}{i}", 4, seed=100 + i) for i in range(50)]
    cfg, topics = _run(kafka, groups, finalize=finalize)
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 50, 120, "50 groups")
    rows, summaries = _outputs(kafka, topics)
    assert len(rows) == 200 and all(r["valid"] for r in rows)
    _assert_exactly_once(rows, summaries, groups, finalize)
    plans = read_all(kafka.bootstrap, topics.route_plans)
    if mode == "direct":
        assert plans == [] and all(r["routed_experts"] is not None for r in rows)
    else:
        decoded = [PLANS.decode(m.value()) for m in plans]
        assert len(decoded) == 200 and all(r["routed_experts"] is None for r in rows)
        assert all(span["fragment"] is not None for plan in decoded for span in plan["spans"])


def test_an_aborted_transaction_is_rewound_and_every_group_published_once(kafka, monkeypatch):
    finalize = ReassemblyConfig()
    groups = [make_group(f"abort{i}", 3, seed=200 + i, routes=None) for i in range(8)]
    cfg, topics = _run(kafka, groups, finalize=finalize, publish_linger_ms=200)
    with RunningStage(cfg) as stage:
        publisher = stage.runtime.publisher
        real, failed = publisher.publish, []

        def fail_once(batch, consumer):
            if not failed and batch.records:
                failed.append(len(batch.records))
                real_begin_produce_abort(batch, consumer)
                raise PublishAborted("injected: transaction must abort")
            return real(batch, consumer)

        def real_begin_produce_abort(batch, consumer):
            # really open a transaction with the outputs, then abort it (as the error path does)
            publisher.producer.begin_transaction()
            for topic, partition, key, value, headers in batch.records:
                publisher.producer.produce(topic, key=key, value=value, partition=partition)
            publisher.producer.flush(30)
            publisher.abort()

        monkeypatch.setattr(publisher, "publish", fail_once)
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 8, 90, "all groups")
        assert stage.runtime.stats.total("transactions_aborted") == 1 and failed
    rows, summaries = _outputs(kafka, topics)
    _assert_exactly_once(rows, summaries, groups, finalize)
    uncommitted = read_all(kafka.bootstrap, topics.finalized_groups, isolation="read_uncommitted")
    assert len(uncommitted) > len(summaries)          # the aborted copy exists, but is invisible


def test_at_least_once_mode_delivers_then_commits(kafka):
    finalize = ReassemblyConfig()
    groups = [make_group(f"alos{i}", 2, seed=300 + i, routes=None) for i in range(6)]
    cfg, topics = _run(kafka, groups, finalize=finalize, processing="at_least_once")
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 6, 60, "all groups")
    rows, summaries = _outputs(kafka, topics)
    _assert_exactly_once(rows, summaries, groups, finalize)
    from confluent_kafka import Consumer, TopicPartition
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": cfg.group_id})
    committed = consumer.committed([TopicPartition(topics.receipts, p) for p in (0, 1)], timeout=10)
    consumer.close()
    assert sum(tp.offset for tp in committed if tp.offset > 0) == 12   # every receipt committed


def test_back_pressure_pauses_at_the_cap_and_still_publishes_everything(kafka):
    finalize = ReassemblyConfig()
    groups = [make_group(f"bp{i}", 2, seed=400 + i, routes=None) for i in range(20)]
    cfg, topics = _run(kafka, groups, finalize=finalize, max_buffered_groups=3, max_inflight_groups=2)
    paused = []
    stage = RunningStage(cfg)
    pauses = stage.runtime.pauses
    apply = pauses.apply

    def spy_apply(consumer, reasons):   # each change of the BACKPRESSURE reason
        now = any(BACKPRESSURE in why for why in reasons.values())
        if now != (paused[-1] if paused else False):
            paused.append(now)
        apply(consumer, reasons)

    # before the loop starts: the cap is hit on the first batch
    pauses.apply = spy_apply
    with stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 20, 90, "all groups")
    assert True in paused and False in paused          # paused at the cap, resumed when drained
    rows, summaries = _outputs(kafka, topics)
    _assert_exactly_once(rows, summaries, groups, finalize)
