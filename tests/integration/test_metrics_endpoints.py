"""/metrics, /healthz and /readyz scraped during a real run; the counts match the outputs."""

import re
import urllib.error
import urllib.request

from stage.brokers.kraft import free_port
from stage.wire import AvroCodec
from tests.integration.harness import (
    Feeder, RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics,
)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _sample(text: str, metric: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{metric}(?:\{{(.*)\}})? (\S+)$", line)
        if match and (not labels or ",".join(sorted((match.group(1) or "").split(","))) == want):
            total += float(match.group(2))
    return total


def _series(text: str, metric: str, **labels) -> list[float]:
    """Values of the series of ``metric`` carrying (at least) these labels; [] when none exists."""
    found = []
    for line in text.splitlines():
        match = re.match(rf"^{metric}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "").split(",") for k, v in labels.items()):
            found.append(float(match.group(2)))
    return found


def test_metrics_and_health_during_a_real_run(kafka):
    topics = unique_topics()
    port = free_port()
    cfg = stage_config(kafka.bootstrap, topics, metrics_port=port, statistics_interval_ms=500,
                       group_timeout_ms=3000)
    setup_topics(cfg, partitions=2)
    feed = Feeder(kafka.bootstrap, topics)
    groups = [make_group(f"m{i}", 3, seed=10 + i) for i in range(4)]
    for spec in groups:
        feed.staged(spec)
    poisoned = dict(groups[0].receipts[0], receipt=dict(groups[0].receipts[0]["receipt"], capture_poisoned=True,
                                                         failure_reason="worker_capture_failed"))
    feed.receipts(groups[0], [poisoned] + groups[0].receipts[1:])
    for spec in groups[1:3]:
        feed.receipts(spec)
    feed.receipts(groups[3], groups[3].receipts[:2])      # one receipt short: deadline
    feed.raw(topics.receipts, b"m9", b"\xff\xfe not avro")
    feed.flush()
    with RunningStage(cfg) as stage:
        status, text = _get(port, "/readyz")
        stage.wait(lambda: _get(port, "/readyz")[0] == 200, 60, "readiness")
        assert _get(port, "/healthz")[0] == 200
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 4, 60, "publication")
        stage.wait(lambda: "rollout_reassembler_consumer_lag{" in _get(port, "/metrics")[1], 30, "lag gauge")
        status, metrics = _get(port, "/metrics")
        assert status == 200
        ready_text = _get(port, "/readyz")[1]
        assert _get(port, "/nope")[0] == 404
    summaries = [AvroCodec("GroupSummary").decode(m.value()) for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    rows = [AvroCodec("CanonicalRow").decode(m.value()) for m in read_all(kafka.bootstrap, topics.canonical_rows)]
    p = "rollout_reassembler_"
    assert _sample(metrics, p + "groups_published_total") == len(summaries) == 4
    assert _sample(metrics, p + "groups_published_total", outcome="deadline") == 1
    assert _sample(metrics, p + "rows_published_total", valid="true") == sum(r["valid"] for r in rows) == 10
    assert _sample(metrics, p + "rows_published_total", valid="false") == 2
    assert _sample(metrics, p + "rejections_total", bucket="rollout_failed") == 1
    assert _sample(metrics, p + "rejections_total", bucket="missing_receipt") == 1
    assert _sample(metrics, p + "dead_letters_total", topic=topics.receipts, reason="undecodable") == 1
    consumed = _sample(metrics, p + "records_consumed_total")
    # every consumed record counts, the dead-lettered one included
    assert consumed == sum(len(g.staged) for g in groups) + 3 + 3 + 3 + 2 + 1
    assert _sample(metrics, p + "transactions_committed_total") >= 1
    assert _sample(metrics, p + "finalize_seconds_count") == 4
    assert _sample(metrics, p + "end_to_end_seconds_count") == 4
    assert _sample(metrics, p + "group_metric_count", name="finalize/invalid_row_rate") == 4
    assert _sample(metrics, p + "assigned_partitions") == 4
    assert "2 partitions assigned: 4 topic-partitions" in ready_text   # /readyz counts as the gauge does
    # series alerts read exist at 0 before their first event (created when the stage starts)
    assert _series(metrics, p + "dead_letters_total", topic=topics.staged_calls) == [0] * 4  # by reason
    assert _series(metrics, p + "groups_published_total", outcome="dropped") == [0]
    assert _series(metrics, p + "rebalances_total", kind="lost") == [0]
    # the settings alert thresholds use, process metrics and the build
    assert _series(metrics, p + "config_group_timeout_seconds") == [3]
    assert _series(metrics, p + "config_max_buffered_bytes") == [cfg.max_buffered_bytes]
    assert _series(metrics, "process_resident_memory_bytes")[0] > 0
    assert _series(metrics, "python_gc_collections_total", generation="0")
    assert _series(metrics, p + "build_info") == [1]
