"""The stage on a real broker: deadlines without traffic, missing receipts and rows, late and
orphan records, dead letters, and deferred route plans fetched by their Kafka coordinates."""

import numpy as np
import torch
from confluent_kafka import Consumer, TopicPartition

from stage.decode import staged_row
from stage.finalize import ReassemblyConfig
from stage.routes import RouteAssemblyPlan, RouteSpan, execute_route_plan
from stage.wire import AvroCodec
from tests.integration.harness import (
    Feeder, RunningStage, expected_rows, make_group, read_all, setup_topics, stage_config, unique_topics,
)

ROWS, SUMMARY, PLANS = AvroCodec("CanonicalRow"), AvroCodec("GroupSummary"), AvroCodec("RoutePlan")


def _setup(kafka, **overrides):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, **overrides)
    setup_topics(cfg, partitions=2)
    return cfg, topics, Feeder(kafka.bootstrap, topics)


def _summaries(kafka, topics):
    return {s["group_id"]: s for s in (SUMMARY.decode(m.value())
                                       for m in read_all(kafka.bootstrap, topics.finalized_groups))}


def _rows(kafka, topics, group_id):
    rows = [ROWS.decode(m.value()) for m in read_all(kafka.bootstrap, topics.canonical_rows)]
    return sorted((r for r in rows if r["group_id"] == group_id), key=lambda r: r["row_index"])


def test_deadline_fires_without_further_traffic_and_missing_pieces_become_placeholders(kafka):
    cfg, topics, feed = _setup(kafka, group_timeout_ms=2500)
    short = make_group("short", 4, seed=1)       # receipt 3 never arrives
    holey = make_group("holey", 2, seed=2)       # one staged call of rollout 1 never arrives
    missing_key = holey.staged[-1]["staging_key"]
    feed.staged(short)
    feed.receipts(short, short.receipts[:3])
    feed.staged(holey, holey.staged[:-1])
    feed.receipts(holey)
    feed.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 2, 60, "deadline publication")
        assert stage.runtime.stats.count("groups_published", outcome="deadline") == 2
    summaries = _summaries(kafka, topics)
    assert summaries["short"]["outcome"] == "deadline" and summaries["short"]["valid_rows"] == 3
    assert [(r["row_index"], r["reason"]) for r in summaries["short"]["rejections"]] == [(3, "missing_receipt")]
    rows = _rows(kafka, topics, "short")
    assert len(rows) == 4 and not rows[3]["valid"] and rows[3]["input_lengths"] == 1
    assert rows[3]["sample_mask"] == 0.0 and rows[3]["rejection_reason"] == "missing_receipt"
    (rejection,) = summaries["holey"]["rejections"]
    assert rejection["row_index"] == 1 and rejection["reason"].startswith("missing_staging_row:")
    assert summaries["holey"]["valid_rows"] == 1 and missing_key.startswith("holey-r1/")


def test_missing_receipt_event_completes_the_group_at_once(kafka):
    cfg, topics, feed = _setup(kafka, group_timeout_ms=600_000)   # no deadline can help
    spec = make_group("gone", 3, seed=3)
    feed.staged(spec)
    gone = dict(spec.receipts[1], receipt=None)
    feed.receipts(spec, [spec.receipts[0], gone, spec.receipts[2]])
    feed.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "publication")
    summary = _summaries(kafka, topics)["gone"]
    assert summary["outcome"] == "complete" and summary["valid_rows"] == 2
    assert [r["reason"] for r in summary["rejections"]] == ["missing_receipt"]


def test_late_records_are_counted_and_never_republished_and_orphans_expire(kafka):
    cfg, topics, feed = _setup(kafka, group_timeout_ms=2000)
    spec = make_group("early", 2, seed=4)
    orphan = make_group("orphan", 1, seed=5)
    feed.staged(spec)
    feed.receipts(spec)
    feed.staged(orphan)                          # its receipt never comes
    feed.flush()
    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("groups_published") >= 1, 60, "first publication")
        feed.receipts(spec, [spec.receipts[1]])  # a late duplicate of a published group
        feed.staged(spec, spec.staged[:1])
        feed.flush()
        stage.wait(lambda: stats.count("records_skipped", topic=topics.receipts, reason="late") >= 1
                   and stats.count("records_skipped", topic=topics.staged_calls, reason="late") >= 1,
                   60, "late records")
        stage.wait(lambda: stats.total("orphan_groups_expired") >= 1, 60, "orphan expiry")
        assert stats.total("orphan_staged_expired") == len(orphan.staged)
    summaries = _summaries(kafka, topics)
    assert list(summaries) == ["early"]
    assert len(_rows(kafka, topics, "early")) == 2


def test_garbage_and_truncated_records_go_to_the_dead_letter_topic_and_the_stage_goes_on(kafka):
    cfg, topics, feed = _setup(kafka)
    spec = make_group("fine", 2, seed=6)
    good = feed.receipt_codec.encode(spec.receipts[0])
    feed.raw(topics.receipts, b"fine", b"\x00garbage\xff" * 3, headers=[("trace", b"abc")])
    feed.raw(topics.receipts, b"fine", good[: len(good) // 2])
    feed.raw(topics.staged_calls, b"fine", b"")
    bad_index = dict(spec.receipts[0], rollout_index=7)        # decodes, but violates N
    conflict = dict(spec.receipts[1], group_size=3)            # contradicts the group's N
    feed.receipts(spec, [bad_index])
    feed.staged(spec)
    feed.receipts(spec, [spec.receipts[0], conflict, spec.receipts[1]])
    feed.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "publication")
        stage.wait(lambda: stage.runtime.stats.total("dead_letters") >= 5, 30, "dead letters")
    letters = read_all(kafka.bootstrap, topics.dead_letter, expect=5)
    assert len(letters) == 5
    by_value = {m.value(): dict(m.headers()) for m in letters}
    headers = by_value[b"\x00garbage\xff" * 3]
    assert headers["source-topic"] == topics.receipts.encode() and headers["trace"] == b"abc"
    assert int(headers["source-offset"]) >= 0 and b"WireError" in headers["error"]
    assert good[: len(good) // 2] in by_value and b"" in by_value
    assert b"rollout_index" in by_value[feed.receipt_codec.encode(bad_index)]["error"]
    assert b"conflicts with group fine" in by_value[feed.receipt_codec.encode(conflict)]["error"]
    assert _summaries(kafka, topics)["fine"]["valid_rows"] == 2


def test_copies_with_other_content_are_dead_lettered_as_conflicts_and_identical_ones_skipped(kafka):
    """A second receipt or staged call under a buffered identity with other content was counted
    as a duplicate and skipped without a trace."""
    cfg, topics, feed = _setup(kafka)
    spec = make_group("twice", 2, seed=8)
    other_receipt = dict(spec.receipts[0], reward=0.75)
    other_call = dict(spec.staged[0], digest="f" * 64)
    feed.staged(spec, [spec.staged[0], spec.staged[0], other_call, *spec.staged[1:]])
    feed.receipts(spec, [spec.receipts[0], spec.receipts[0], other_receipt, spec.receipts[1]])
    feed.flush()
    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("groups_published") >= 1 and stats.total("dead_letters") >= 2,
                   60, "publication and dead letters")
        assert stats.count("records_skipped", topic=topics.receipts, reason="duplicate") == 1
        assert stats.count("records_skipped", topic=topics.staged_calls, reason="duplicate") == 1
        assert stats.count("dead_letters", topic=topics.receipts, reason="conflict") == 1
        assert stats.count("dead_letters", topic=topics.staged_calls, reason="conflict") == 1
    letters = {m.value(): dict(m.headers()) for m in read_all(kafka.bootstrap, topics.dead_letter, expect=2)}
    receipt_error = letters[feed.receipt_codec.encode(other_receipt)]["error"].decode()
    assert "rollout_index 0 received twice with different content: reward 0.75 != 0.0" in receipt_error
    staged_error = letters[feed.staged_codec.encode(other_call)]["error"].decode()
    assert f"staging_key {spec.staged[0]['staging_key']!r} staged twice" in staged_error
    assert all(h["error-class"] == b"conflict" for h in letters.values())
    assert _summaries(kafka, topics)["twice"]["valid_rows"] == 2          # the first copies won


def test_deferred_plans_point_at_fetchable_fragments_that_rebuild_the_direct_routes(kafka):
    finalize = ReassemblyConfig(router_replay=True, defer_routes=True)
    cfg, topics, feed = _setup(kafka, finalize=finalize)
    spec = make_group("deferred", 2, seed=7, routes=(3, 2))
    feed.staged(spec)
    feed.receipts(spec)
    feed.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "publication")
    plans = sorted((PLANS.decode(m.value()) for m in read_all(kafka.bootstrap, topics.route_plans)),
                   key=lambda p: p["row_index"])
    assert [p["sample_id"] for p in plans] == ["deferred_g0", "deferred_g1"]
    rows = _rows(kafka, topics, "deferred")
    assert all(r["routed_experts"] is None for r in rows)       # deferred: no routes in rows
    direct = expected_rows(spec, ReassemblyConfig(router_replay=True))
    reader = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "fragment-fetch",
                       "enable.auto.commit": False})
    codec = AvroCodec("StagedCall")
    for plan, row, want in zip(plans, rows, direct):
        fragments = {}
        for span in plan["spans"]:
            coords = span["fragment"]
            reader.assign([TopicPartition(coords["topic"], coords["partition"], coords["offset"])])
            msg = reader.consume(1, timeout=10)[0]
            fragments[span["staging_key"]] = staged_row(codec.decode(msg.value())).fragment()
        route_plan = RouteAssemblyPlan(
            plan["schema_version"], plan["staging_partition"],
            tuple(RouteSpan(s["staging_key"], s["carry_len"], s["generation_len"], s["staged_route_len"],
                            s["extras_digest_version"], s["extras_digest"], s["boundary_token_index"],
                            s["repair_previous_token"]) for s in plan["spans"]),
            tuple(plan["cleanup_staging_keys"]), plan["expected_token_length"])
        routes, failure = execute_route_plan(route_plan, fragments, dims=(3, 2),
                                             canonical_len=row["input_lengths"])
        assert failure is None
        expected = np.frombuffer(want["routed_experts"]["data"], dtype="<i2").reshape(want["routed_experts"]["shape"])
        assert torch.equal(routes, torch.from_numpy(expected.copy()))
    reader.close()


def test_a_row_over_max_record_bytes_reaches_the_trainer_whole(kafka):
    """Direct router replay at L=16, K=8 (256 route bytes a token): calls of 700 and 500 tokens make a
    ~330 kB row, over a 256 KiB max_record_bytes; each staged call is under it. The WireError
    "over max_record_bytes" halted the partition; now the row is published in parts and the
    reader, given the stage's max_record_bytes, hands out the group whole."""
    from stage.client import CanonicalReader

    finalize = ReassemblyConfig(router_replay=True, route_layers=16, route_topk=8)
    cap = 256 << 10
    cfg, topics, feed = _setup(kafka, finalize=finalize, max_record_bytes=cap)
    spec = make_group("long", 2, calls=2, seed=9, routes=(16, 8), prompt=(300, 100), generated=400)
    feed.staged(spec)
    feed.receipts(spec)
    feed.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "publication")
        assert not stage.runtime.halted
    blobs = [m.value() for m in read_all(kafka.bootstrap, topics.canonical_rows)]
    assert len(blobs) > 2 and all(len(b) <= cap for b in blobs)
    with CanonicalReader(kafka.bootstrap, topics=topics, max_record_bytes=cap) as reader:
        (group,) = reader.read(1, timeout=60)
    want = expected_rows(spec, finalize)
    assert [r.sample_id for r in group.rows] == ["long_g0", "long_g1"] and group.valid_rows == 2
    assert [ROWS.encode(r) for r in group.records] == [ROWS.encode(r) for r in want]
    assert group.tensors()["routed_experts"].shape[2:] == (16, 8)
