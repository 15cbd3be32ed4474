"""Static group membership as the chart configures it (staticMembership.enabled): the consumer
properties group.instance.id and session.timeout.ms passed through the stage's consumer
settings. A restarted member with the same instance id takes its place and publishes once."""

from confluent_kafka import Consumer

from stage.runtime.kafka.clients import consumer_config
from stage.wire import AvroCodec
from tests.integration.harness import (
    Feeder, RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics,
)


def static_stage(kafka, instance_id: str, prefix: str):
    """A static member's config (what the chart's ROLLOUT_REASSEMBLER_CONSUMER__GROUP_INSTANCE_ID /
    ..._SESSION_TIMEOUT_MS give), its topics, a feeder, the first group fed and a second one."""
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=3000,
                       consumer={"group.instance.id": instance_id, "session.timeout.ms": "30000",
                                 "heartbeat.interval.ms": 500})
    setup_topics(cfg, partitions=2)
    feed = Feeder(kafka.bootstrap, topics)
    first, second = make_group(f"{prefix}1", 2, seed=1), make_group(f"{prefix}2", 2, seed=2)
    feed.staged(first)
    feed.receipts(first)
    feed.flush()
    return topics, cfg, feed, second


def test_a_static_member_restarts_under_its_instance_id_and_publishes_exactly_once(kafka):
    topics, cfg, feed, second = static_stage(kafka, "rr-rollout-reassembler-0", "s")
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "first group")
    feed.staged(second)
    feed.receipts(second)
    feed.flush()
    # the same instance id again, well within the 30 s session: it replaces its predecessor
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.ready, 25, "the partitions back")
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "second group")
        assert stage.runtime.stats.total("groups_published") == 1  # the first is not republished
    summaries = [AvroCodec("GroupSummary").decode(m.value())
                 for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    assert sorted(s["group_id"] for s in summaries) == ["s1", "s2"]


def test_a_consumer_fenced_for_its_instance_id_is_replaced_and_the_stage_publishes_on(kafka):
    """The coordinator fences a static member when another JoinGroup arrives with its id: a
    second copy of the replica, or (the soak) the replica's own JoinGroup held by a network
    partition and delivered late. librdkafka's consumer is then done for; the stage drops its
    partitions as lost and joins again with a new consumer: no exit, no silent stall."""
    topics, cfg, feed, second = static_stage(kafka, "rr-fenced-0", "f")
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "first group")
        fenced = stage.runtime.clients.consumer
        intruder = Consumer({k: v for k, v in consumer_config(cfg).items() if k != "logger"})
        intruder.subscribe([topics.receipts])
        try:
            stage.wait(lambda: (intruder.poll(0.1), stage.runtime.clients.consumer is not fenced)[1], 60,
                       "the fenced consumer replaced")
        finally:
            try:
                intruder.close()
            except Exception:  # noqa: BLE001 - fenced in its turn by the stage's new consumer
                pass
        feed.staged(second)
        feed.receipts(second)
        feed.flush()
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 2, 90, "second group")
        stage.wait(lambda: stage.runtime.ready, 60, "ready again")
    summaries = [AvroCodec("GroupSummary").decode(m.value())
                 for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    assert sorted(s["group_id"] for s in summaries) == ["f1", "f2"]
