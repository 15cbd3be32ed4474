"""Group-level receipt fields on a real broker: per-rollout result_stats are summed into the
group's per-label metrics, a receipt contradicting its group's fields is dead-lettered with the
conflict named while the group publishes with the first receipt's values, the summary's first
input timestamp is the group's earliest, and a null-valued record is dead-lettered as null."""

import time

from stage.wire import AvroCodec
from tests.integration.harness import (
    Feeder, RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics,
)

ROWS, SUMMARY = AvroCodec("CanonicalRow"), AvroCodec("GroupSummary")
LABELS = [{"scope": "harness", "name": "h"}, {"scope": "agent", "name": "a"}]
GROUP_FIELDS = dict(prompt_idx=7, loss_multiplier=0.5, fallback_weight_version=2, labels=LABELS)
CONFLICTS = [  # (changed fields, the error text the dead letter must carry)
    (dict(prompt_idx=3), "prompt_idx 3 != 7"),
    (dict(loss_multiplier=0.25), "loss_multiplier 0.25 != 0.5"),
    (dict(fallback_weight_version=9), "fallback_weight_version 9 != 2"),
    (dict(labels=LABELS[:1]), "labels [('harness', 'h')] != [('agent', 'a'), ('harness', 'h')]"),
]


def test_result_stats_sum_and_conflicting_receipts_are_dead_lettered(kafka):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    setup_topics(cfg, partitions=2)
    feed = Feeder(kafka.bootstrap, topics)
    spec = make_group("stats", 4, seed=11)
    receipts = [dict(r, **GROUP_FIELDS, result_stats=[{"field": "score", "sum": float(i + 1), "count": 1}])
                for i, r in enumerate(spec.receipts)]
    conflicting = [dict(receipts[1], **changed) for changed, _ in CONFLICTS]
    feed.staged(spec)
    feed.receipts(spec, [receipts[0]] + conflicting + receipts[1:3])
    # The last receipt read carries the group's earliest timestamp.
    earliest = int(time.time() * 1000) - 2000
    feed.producer.produce(topics.receipts, key=b"stats", value=feed.receipt_codec.encode(receipts[3]),
                          timestamp=earliest)
    feed.raw(topics.receipts, b"null-valued", None)
    feed.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "publication")
        stage.wait(lambda: stage.runtime.stats.total("dead_letters") >= 5, 30, "dead letters")
    letters = read_all(kafka.bootstrap, topics.dead_letter, expect=5)
    assert len(letters) == 5
    by_key_value = {(m.key(), m.value()): dict(m.headers()) for m in letters}
    for value, (_, text) in zip(conflicting, CONFLICTS):
        headers = by_key_value[(b"stats", feed.receipt_codec.encode(value))]
        assert headers["error"].decode() == (
            f"DecodeError: conflicts with group stats: {text} (first receipt rollout_index 0)")
    null = by_key_value[(b"null-valued", None)]
    assert null["error"].startswith(b"DecodeError: the record has no value")
    assert null["error-class"] == b"undecodable"

    (summary,) = [SUMMARY.decode(m.value()) for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    assert summary["outcome"] == "complete" and summary["valid_rows"] == 4
    metrics = summary["metrics"]
    assert metrics["group_stats/harness/h/result_sum/score"] == 10.0
    assert metrics["group_stats/harness/h/result_count/score"] == 4.0
    assert metrics["group_stats/agent/a/rollouts"] == 4.0                 # both labels, once each
    assert not any(key.startswith("group_stats/agent/a/result_") for key in metrics)
    assert summary["prompt_idx"] == 7
    assert summary["first_input_timestamp_ms"] == earliest
    assert summary["last_input_timestamp_ms"] > earliest
    rows = [ROWS.decode(m.value()) for m in read_all(kafka.bootstrap, topics.canonical_rows)]
    assert sorted(r["rollout_id"] for r in rows) == [r["rollout_id"] for r in spec.receipts]
    assert {(r["prompt_idx"], r["sample_mask"]) for r in rows} == {(7, 0.5)}


def test_fallback_weight_version_is_the_first_receipts(kafka):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    setup_topics(cfg, partitions=2)
    feed = Feeder(kafka.bootstrap, topics)
    spec = make_group("nothing", 2, seed=12)          # no valid row: the fallback is published
    missing = [dict(r, receipt=None, fallback_weight_version=5) for r in spec.receipts]
    feed.receipts(spec, [missing[0], dict(missing[1], fallback_weight_version=6), missing[1]])
    feed.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "publication")
        stage.wait(lambda: stage.runtime.stats.total("dead_letters") >= 1, 30, "dead letter")
    (letter,) = read_all(kafka.bootstrap, topics.dead_letter, expect=1)
    headers = dict(letter.headers())
    assert headers["error"] == (b"DecodeError: conflicts with group nothing: "
                                b"fallback_weight_version 6 != 5 (first receipt rollout_index 0)")
    assert headers["error-class"] == b"conflict"
    (summary,) = [SUMMARY.decode(m.value()) for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    assert (summary["group_min_wv"], summary["group_max_wv"], summary["valid_rows"]) == (5, 5, 0)
