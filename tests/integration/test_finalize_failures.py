"""Failures that would fail every group are never committed as ``dropped`` group after group: a
finalize device that does not exist stops the stage before it joins the group, and a group that
fails in finalization for a system cause (stage.finalize.failures) halts its partition (nothing
published or committed past it, readiness false, counted) while the other partitions go on.
Input that used to halt a partition (direct router replay without routes before (L, K) is
known) is published and committed past."""

import pytest
import torch
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.finalize import GroupFinalizer, ReassemblyConfig
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


def _feed_two_partitions(kafka, topics, bad_routes):
    bad_name, good_name = _names_in_two_partitions()
    bad, good = make_group(bad_name, 2, seed=95, routes=bad_routes), make_group(good_name, 2, seed=96)
    feed = Feeder(kafka.bootstrap, topics)
    for spec in (bad, good):
        feed.staged(spec)
        feed.receipts(spec)
    feed.flush()
    return bad_name, good_name


def _committed(kafka, cfg, topics, partition):
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    request = ConsumerGroupTopicPartitions(cfg.group_id, [TopicPartition(topics.receipts, partition),
                                                          TopicPartition(topics.staged_calls, partition)])
    return admin.list_consumer_group_offsets([request])[cfg.group_id].result().topic_partitions


def test_a_group_that_fails_finalization_for_a_system_cause_halts_its_partition_only(kafka, monkeypatch):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=600_000,
                       finalize=ReassemblyConfig(router_replay=True, defer_routes=False))
    setup_topics(cfg, partitions=2)
    bad_name, good_name = _feed_two_partitions(kafka, topics, bad_routes=(2, 2))
    real = GroupFinalizer._tensorize

    def tensorize(self, group_id, *args, **kwargs):
        if group_id == bad_name:   # the host out of memory: it would fail the next group too
            raise MemoryError()
        return real(self, group_id, *args, **kwargs)

    monkeypatch.setattr(GroupFinalizer, "_tensorize", tensorize)
    with RunningStage(cfg) as stage:
        runtime, stats = stage.runtime, stage.runtime.stats
        stage.wait(lambda: runtime.halted and stats.total("groups_published") >= 1, 60, "halt")
        ok, why = runtime.readiness()
        assert not ok and f"group {bad_name}" in why and "finalize_error: host_memory: MemoryError" in why
        assert stats.total("finalize_errors") == 1 and stats.gauges["halted_partitions"] == 1
        assert stats.count("groups_published", outcome="dropped") == 0
        assert runtime.pauses.why(0) >= {"halted"}
    published = {SUMMARY.decode(m.value())["group_id"] for m in read_all(kafka.bootstrap, topics.finalized_groups)}
    assert published == {good_name}
    assert all(tp.offset <= 0 for tp in _committed(kafka, cfg, topics, 0))   # nothing past the failed group


def test_direct_replay_without_routes_before_the_dims_are_known_is_published_not_halted(kafka):
    """It halted the partition for good (NeMo RL's RuntimeError "no finalized rollout has carried
    routed_experts yet"); now its rows are rejected by name and the group committed past."""
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=600_000,
                       finalize=ReassemblyConfig(router_replay=True, defer_routes=False))
    setup_topics(cfg, partitions=1)
    bad, later = make_group("no-routes", 2, seed=95, routes=None), make_group("later", 2, seed=96)
    feed = Feeder(kafka.bootstrap, topics)
    with RunningStage(cfg) as stage:
        runtime, stats = stage.runtime, stage.runtime.stats
        for spec, published in ((bad, 1), (later, 2)):   # in turn: the later group teaches (L, K)
            feed.staged(spec)
            feed.receipts(spec)
            feed.flush()
            stage.wait(lambda: stats.total("groups_published") >= published, 60, spec.group_id)
        assert not runtime.halted and runtime.readiness()[0]
        assert stats.total("finalize_errors") == 0
    summaries = {s["group_id"]: s for s in (SUMMARY.decode(m.value())
                                           for m in read_all(kafka.bootstrap, topics.finalized_groups))}
    assert [r["reason"] for r in summaries["no-routes"]["rejections"]] == ["route_dims_unknown"] * 2
    assert summaries["no-routes"]["outcome"] == "dropped" and summaries["later"]["valid_rows"] == 2
    ends = {topics.receipts: 4, topics.staged_calls: 12}   # 2 groups x (2 receipts, 6 staged calls)
    assert {tp.topic: tp.offset for tp in _committed(kafka, cfg, topics, 0)} == ends
