"""Static group membership as the chart configures it (staticMembership.enabled): the consumer
properties group.instance.id and session.timeout.ms passed through the stage's consumer
settings. A restarted member with the same instance id takes its place and publishes once."""

from stage.wire import AvroCodec
from tests.integration.harness import (
    Feeder, RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics,
)


def test_a_static_member_restarts_under_its_instance_id_and_publishes_exactly_once(kafka):
    topics = unique_topics()
    # what the chart's ROLLOUT_REASSEMBLER_CONSUMER__GROUP_INSTANCE_ID / ..._SESSION_TIMEOUT_MS give
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=3000,
                       consumer={"group.instance.id": "rr-rollout-reassembler-0", "session.timeout.ms": "30000",
                                 "heartbeat.interval.ms": 500})
    setup_topics(cfg, partitions=2)
    feed = Feeder(kafka.bootstrap, topics)
    first, second = make_group("s1", 2, seed=1), make_group("s2", 2, seed=2)
    feed.staged(first)
    feed.receipts(first)
    feed.flush()
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
