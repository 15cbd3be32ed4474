"""The stage's metrics registry at start: alerted-on series created at 0, the settings alert
thresholds use, process/GC/platform metrics, build_info and the cgroup memory limit, all on the
registry /metrics serves."""

from __future__ import annotations

import subprocess
import tomllib
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stage.observability import PrometheusSink
from stage.observability.metrics import INITIAL_LABELS, INPUT_TOPICS, label_combinations
from stage.observability.process import CgroupMemoryLimit, memory_limit_bytes
from stage.config.model import StageConfig
from stage.wire import TopicNames
from tests.ops.support import ROOT, health_server


def samples(registry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels) -> float | None:
    return found.get((name, frozenset(labels.items())))


def test_configure_creates_alerted_series_at_zero_for_the_configured_topics():
    topics = TopicNames(receipts="team.receipts", staged_calls="team.staged")
    sink = PrometheusSink()
    before = samples(sink.registry)
    assert value(before, "rollout_reassembler_dead_letters_total", topic="team.receipts",
                 reason="misrouted") is None
    sink.configure(StageConfig(topics=topics, group_timeout_ms=45_000, max_buffered_bytes=1 << 30))
    found = samples(sink.registry)
    p = "rollout_reassembler_"
    for topic in ("team.receipts", "team.staged"):
        for reason in ("undecodable", "invalid", "misrouted", "conflict"):
            assert value(found, p + "dead_letters_total", topic=topic, reason=reason) == 0
        assert value(found, p + "records_consumed_total", topic=topic) == 0
        assert value(found, p + "records_skipped_total", topic=topic, reason="late") == 0
    for outcome in ("complete", "deadline", "dropped"):
        assert value(found, p + "groups_published_total", outcome=outcome) == 0
    assert value(found, p + "rows_published_total", valid="false") == 0
    assert value(found, p + "rebalances_total", kind="lost") == 0
    assert value(found, p + "config_group_timeout_seconds") == 45
    assert value(found, p + "config_max_buffered_bytes") == 1 << 30
    assert value(found, p + "config_max_buffered_groups") == StageConfig().max_buffered_groups
    # the first event increments the series created at start (no second series)
    sink.inc("dead_letters", 1, {"topic": "team.receipts", "reason": "misrouted"})
    sink.inc("groups_published", 1, {"outcome": "dropped"})
    found = samples(sink.registry)
    assert value(found, p + "dead_letters_total", topic="team.receipts", reason="misrouted") == 1
    assert value(found, p + "groups_published_total", outcome="dropped") == 1
    assert len([k for k in found if k[0] == p + "dead_letters_total"]) == 2 * 4


def test_every_initial_label_table_entry_names_a_metric_and_all_its_labels():
    sink = PrometheusSink()
    for key, labels in INITIAL_LABELS.items():
        metric = sink.counters.get(key) or sink.gauges.get(key)
        assert metric is not None, key
        assert set(labels) == set(metric._labelnames), key
    combos = label_combinations({"topic": INPUT_TOPICS, "reason": ("a", "b")}, {INPUT_TOPICS: ("x", "y")})
    assert combos == [{"topic": "x", "reason": "a"}, {"topic": "x", "reason": "b"},
                      {"topic": "y", "reason": "a"}, {"topic": "y", "reason": "b"}]


def test_process_metrics_and_build_info_are_served_on_metrics():
    with health_server() as port:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                 "process_max_fds", "process_start_time_seconds", "python_gc_collections_total",
                 "python_info", "rollout_reassembler_build_info"):
        assert name in names, name
    (build,) = [s for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "rollout_reassembler_build_info"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert build.value == 1 and build.labels["version"] == version
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # a checkout: the commit it is at
        assert build.labels["commit"] == head.stdout.strip()


@pytest.mark.parametrize("files, limit", [
    ({"memory.max": "8589934592\n"}, 8589934592),                    # cgroup v2
    ({"memory.max": "max\n"}, None),                                 # v2, no limit
    ({"memory.limit_in_bytes": "2147483648\n"}, 2147483648),         # cgroup v1
    ({"memory.limit_in_bytes": "9223372036854771712\n"}, None),      # v1, no limit
    ({}, None),                                                      # no cgroup files
])
def test_memory_limit_comes_from_the_cgroup(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    paths = (tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes")
    assert memory_limit_bytes(paths) == limit
    (family,) = CgroupMemoryLimit(paths).collect()
    assert family.name == "rollout_reassembler_memory_limit_bytes"
    assert [s.value for s in family.samples] == ([] if limit is None else [limit])


def test_the_route_topic_gets_its_series_only_where_the_stage_reads_it():
    """Direct router replay reads the route topic (a third input): its alerted series start at 0
    there, and nowhere else (a deferred stage never reads it)."""
    p = "rollout_reassembler_"
    for direct, expected in ((True, 0), (False, None)):
        sink = PrometheusSink()
        sink.configure(StageConfig(finalize={"router_replay": True, "defer_routes": not direct,
                                             "route_layers": 48, "route_topk": 8}))
        found = samples(sink.registry)
        assert value(found, p + "records_consumed_total", topic=TopicNames().staged_routes) == expected
        assert value(found, p + "records_consumed_total", topic=TopicNames().staged_calls) == 0
