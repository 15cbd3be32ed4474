"""Every group open at once and more staged bytes than max_buffered_bytes: the stage cannot
pause its input (every group waits for receipts it has not read), so the staged calls it admits
past the cap go to local disk and come back when their group is finalized. Rows are the
library's, byte for byte, in direct router replay (route payloads spilled too) and without
routes; the spill directory is empty once the stage stops."""

import pytest

from stage.finalize import ReassemblyConfig
from stage.runtime.steps.intake import SPILLED_ITEM_BYTES
from stage.wire import AvroCodec
from tests.integration.harness import (
    Feeder, RunningStage, expected_rows, make_group, read_all, rows_by_group, setup_topics, stage_config,
    unique_topics,
)

ROWS = AvroCodec("CanonicalRow")


DIRECT = ReassemblyConfig(router_replay=True, defer_routes=False, route_layers=2, route_topk=2)


@pytest.mark.parametrize("finalize, pool", [
    (DIRECT, {}),
    (ReassemblyConfig(), {}),
    (DIRECT, {"finalize_pool": "process", "finalize_workers": 2}),
], ids=["direct-routes", "no-routes", "direct-routes-in-processes"])
def test_groups_open_past_the_cap_spill_to_disk_and_publish_the_librarys_rows(kafka, tmp_path, finalize, pool):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, finalize=finalize, group_timeout_ms=120_000,
                       max_buffered_bytes=64 * 1024, spill_dir=str(tmp_path), **pool)
    setup_topics(cfg, partitions=2)
    groups = [make_group(f"sp{i}", 4, calls=4, seed=700 + i) for i in range(8)]
    feeder = Feeder(kafka.bootstrap, topics)
    for spec in groups:                      # every group's staged calls first: all open at once
        feeder.staged(spec)
    feeder.flush()
    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("records_consumed") >= sum(len(g.staged) for g in groups), 60,
                   "staged calls buffered")
        spilled = stats.total("records_spilled")
        assert spilled > 0 and stats.gauges["spilled_bytes"] > 0
        # past the cap only the small decoded fields of each spilled record stay in memory
        assert stats.gauges["held_bytes"] <= cfg.max_buffered_bytes + 16 * 1024 + spilled * SPILLED_ITEM_BYTES
        for spec in groups:
            feeder.receipts(spec)
        feeder.flush()
        stage.wait(lambda: stats.total("groups_published") >= len(groups), 90, "all groups published")
        assert stats.gauges["spilled_bytes"] == 0          # released as the groups were published
    assert not any(tmp_path.rglob("segment-*"))
    rows = [ROWS.decode(m.value()) for m in read_all(kafka.bootstrap, topics.canonical_rows)]
    by_group = rows_by_group(rows)
    for spec in groups:
        got = by_group[spec.group_id]
        assert got == expected_rows(spec, finalize)
