"""The stage refuses to start on a topic layout that breaks co-partitioning."""

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from stage.runtime.exits import EXIT_TOPOLOGY, StageExit
from stage.runtime.loop import StageRuntime
from stage.runtime.topics import TopologyError, check_copartitioning, create_topics
from tests.integration.harness import stage_config, unique_topics


def test_missing_and_mismatched_topics_are_refused_with_a_clear_message(kafka):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    with pytest.raises(TopologyError, match="missing topics: receipts"):
        check_copartitioning(admin, cfg)
    for future in admin.create_topics([NewTopic(topics.receipts, 3, 1)]).values():
        future.result()
    created = create_topics(admin, cfg, partitions=2)
    assert topics.receipts not in created and topics.staged_calls in created
    with pytest.raises(TopologyError, match=r"same number of partitions.*receipts=3.*staged-calls=2"):
        check_copartitioning(admin, cfg)
    with pytest.raises(StageExit, match=r"refusing to start: .*same number of partitions") as info:
        StageRuntime(cfg).start()
    assert info.value.code == EXIT_TOPOLOGY


def test_created_layout_passes_and_the_ledger_is_compacted(kafka):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    create_topics(admin, cfg, partitions=3)
    assert check_copartitioning(admin, cfg) == 3
    from confluent_kafka.admin import ConfigResource
    resource = ConfigResource(ConfigResource.Type.TOPIC, topics.stage_ledger)
    configs = admin.describe_configs([resource])[resource].result()
    assert configs["cleanup.policy"].value == "compact"
    assert create_topics(admin, cfg, partitions=3) == []     # idempotent
