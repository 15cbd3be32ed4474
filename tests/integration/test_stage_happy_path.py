"""The stage on a real broker: complete groups publish exactly N rows equal to the library's,
whether finalization runs on a thread or in worker processes."""

import pytest

from stage.finalize import ReassemblyConfig
from stage.wire import AvroCodec
from tests.integration.harness import (
    Feeder, RunningStage, expected_rows, make_group, read_all, rows_by_group, setup_topics, stage_config,
    unique_topics,
)

ROWS = AvroCodec("CanonicalRow")
SUMMARY = AvroCodec("GroupSummary")


@pytest.mark.parametrize("pool", [{}, {"finalize_pool": "process", "finalize_workers": 2}],
                         ids=["thread", "processes"])
def test_complete_groups_publish_exactly_n_rows_equal_to_the_library(kafka, pool):
    topics = unique_topics()
    finalize = ReassemblyConfig(router_replay=True, defer_routes=False, route_layers=2, route_topk=2)
    cfg = stage_config(kafka.bootstrap, topics, finalize=finalize, **pool)
    setup_topics(cfg, partitions=2)
    groups = [make_group(f"g{i}", 4, seed=i) for i in range(6)]
    feeder = Feeder(kafka.bootstrap, topics)
    for spec in groups:
        feeder.staged(spec)
        feeder.receipts(spec)
    feeder.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= len(groups), 90,
                   "all groups published")
    rows = [ROWS.decode(m.value()) for m in read_all(kafka.bootstrap, topics.canonical_rows)]
    summaries = [SUMMARY.decode(m.value()) for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    assert sorted(s["group_id"] for s in summaries) == sorted(g.group_id for g in groups)
    assert all(s["outcome"] == "complete" and s["valid_rows"] == 4 for s in summaries), [(s["outcome"], s["valid_rows"], s["rejections"], s["drop_reason"]) for s in summaries]
    by_group = rows_by_group(rows)
    for spec in groups:
        got = by_group[spec.group_id]
        assert [r["sample_id"] for r in got] == [f"{spec.group_id}_g{i}" for i in range(4)]
        assert got == expected_rows(spec, finalize)
