"""Failures that would fail every group are never committed as ``dropped`` group after group: a
finalize device that does not exist stops the stage before it joins the group, and a group that
fails in finalization halts its partition (nothing published or committed past it, readiness
false, counted) while the other partitions go on."""

import pytest
import torch
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.finalize import ReassemblyConfig
from stage.runtime.exits import EXIT_DEVICE, StageExit
from stage.runtime.loop import StageRuntime
from stage.wire import AvroCodec
from stage.wire.partitioner import partition_for
from tests.integration.harness import (
    Feeder, RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics,
)

SUMMARY = AvroCodec("GroupSummary")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_a_cuda_device_on_a_host_without_cuda_refuses_to_start(kafka):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, finalize=ReassemblyConfig(device="cuda"))
    setup_topics(cfg, partitions=1)
    runtime = StageRuntime(cfg)
    with pytest.raises(StageExit, match="finalize device 'cuda' cannot be used") as info:
        runtime.start()
    assert info.value.code == EXIT_DEVICE
    assert runtime.consumer is None          # it never joined the group


def _names_in_two_partitions():
    by_partition = {}
    for i in range(100):
        by_partition.setdefault(partition_for(f"g{i}".encode(), 2), f"g{i}")
    return by_partition[0], by_partition[1]


def test_a_group_that_fails_finalization_halts_its_partition_only(kafka):
    topics = unique_topics()
    # Direct router replay, and rows that carry no routes while (L, K) is unknown: NeMo RL's
    # finalizer fails loudly, and would for every group of this deployment.
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=600_000,
                       finalize=ReassemblyConfig(router_replay=True, defer_routes=False))
    setup_topics(cfg, partitions=2)
    bad_name, good_name = _names_in_two_partitions()
    bad, good = make_group(bad_name, 2, seed=95, routes=None), make_group(good_name, 2, seed=96)
    feed = Feeder(kafka.bootstrap, topics)
    for spec in (bad, good):
        feed.staged(spec)
        feed.receipts(spec)
    feed.flush()
    with RunningStage(cfg) as stage:
        runtime, stats = stage.runtime, stage.runtime.stats
        stage.wait(lambda: runtime.halted and stats.total("groups_published") >= 1, 60, "halt")
        ok, why = runtime.readiness()
        assert not ok and f"group {bad_name}" in why and "finalize_error" in why
        assert stats.total("finalize_errors") == 1 and stats.gauges["halted_partitions"] == 1
        assert stats.count("groups_published", outcome="dropped") == 0
        assert runtime.pauses.why(0) >= {"halted"}
    published = {SUMMARY.decode(m.value())["group_id"] for m in read_all(kafka.bootstrap, topics.finalized_groups)}
    assert published == {good_name}
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    request = ConsumerGroupTopicPartitions(cfg.group_id, [TopicPartition(topics.receipts, 0),
                                                          TopicPartition(topics.staged_calls, 0)])
    committed = admin.list_consumer_group_offsets([request])[cfg.group_id].result().topic_partitions
    assert all(tp.offset <= 0 for tp in committed)   # nothing committed past the failed group
