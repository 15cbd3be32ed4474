"""``rollout-reassembler dead-letters list|replay`` on a real broker.

A group's receipt produced with the wrong key is dead-lettered as misrouted while the group waits
for it; a garbage record keyed by the group is dead-lettered as undecodable. ``list`` shows both
with their source coordinates; ``replay`` refuses the misrouted one without ``--rekey``, refuses
the undecodable one, re-produces the misrouted one keyed by its group with ``--rekey`` (the stage
then completes the group), and a second replay re-produces nothing."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaException

from stage.debug.deadletters import REPLAY_HEADER, Filters, Replayer, find
from stage.debug.kafka import PartitionReader
from stage.runtime.loop import build_codecs
from stage.wire import AvroCodec
from stage.wire.partitioner import partition_for
from tests.debug.helpers import CoordinateFeeder, run_cli
from tests.integration.harness import RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics

SUMMARY = AvroCodec("GroupSummary")


GARBAGE = b"\x00garbage"


def _receipts_of(kafka, topics, key: bytes):
    """The receipts keyed ``key`` (the garbage record aside)."""
    return [m for m in read_all(kafka.bootstrap, topics.receipts) if m.key() == key and m.value() != GARBAGE]


def _summaries(kafka, topics):
    return [SUMMARY.decode(m.value()) for m in read_all(kafka.bootstrap, topics.finalized_groups)]


def test_list_then_replay_a_misrouted_receipt_once_and_the_group_completes(kafka, capsys, tmp_path):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=120_000)   # waits for the replay
    setup_topics(cfg, partitions=2)
    spec = make_group("dl", 2, seed=6)
    feeder = CoordinateFeeder(kafka.bootstrap, topics)
    feeder.staged(spec)
    feeder.receipts(spec, spec.receipts[:1])
    feeder.send(topics.receipts, b"not-the-group", feeder.receipt_codec.encode(spec.receipts[1]),
                headers=[("trace", b"t-1")])
    feeder.send(topics.receipts, b"dl", GARBAGE, partition=partition_for(b"dl", 2))
    feeder.flush()
    (wrong,) = feeder.where(topics.receipts, b"not-the-group")
    with RunningStage(cfg) as stage:
        stage.wait(lambda: len(read_all(kafka.bootstrap, topics.dead_letter, timeout=2)) >= 2, 60,
                   "two dead letters")

        rc, listing, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "list")
        assert rc == 0 and listing["matched"] == 2
        by_class = {d["error_class"]: d for d in listing["dead_letters"]}
        assert set(by_class) == {"misrouted", "undecodable"}
        misrouted = by_class["misrouted"]
        assert misrouted["source"] == {"topic": topics.receipts, "partition": wrong[0], "offset": wrong[1]}
        assert misrouted["key"] == "not-the-group" and misrouted["replayed"] is None
        assert "is not the record's group_id 'dl'" in misrouted["error"]
        assert by_class["undecodable"]["value_bytes"] == len(GARBAGE)
        rc, only, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "list", "--error-class", "misrouted")
        assert only["matched"] == 1

        # without --rekey the copy would be dead-lettered again: refused, nothing produced
        rc, out, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "replay", "--error-class", "misrouted")
        assert rc == 1 and out["counts"]["refused"] == 1 and "--rekey" in out["results"][0]["detail"]
        rc, out, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "replay", "--error-class", "undecodable")
        assert rc == 1 and "does not decode" in out["results"][0]["detail"]
        rc, out, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "replay", "--error-class", "misrouted",
                             "--rekey", "--dry-run")
        assert rc == 0 and out["counts"]["would_replay"] == 1
        assert len(_receipts_of(kafka, topics, b"dl")) == 1
        assert not _summaries(kafka, topics)                      # the group still waits

        rc, out, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "replay", "--error-class", "misrouted",
                             "--rekey")
        assert rc == 0 and out["counts"]["replayed"] == 1, out
        stage.wait(lambda: _summaries(kafka, topics), 60, "the group's publication")
        (summary,) = _summaries(kafka, topics)
        assert summary["outcome"] == "complete" and summary["valid_rows"] == 2

        rc, again, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "replay", "--error-class", "misrouted",
                               "--rekey")
        assert rc == 0 and again["counts"] == {"replayed": 0, "would_replay": 0, "already_replayed": 1,
                                               "refused": 0}
    copies = _receipts_of(kafka, topics, b"dl")
    assert len(copies) == 2                                         # the original r0 and one copy
    (copy,) = [m for m in copies if REPLAY_HEADER in dict(m.headers() or [])]
    headers = dict(copy.headers())
    assert copy.partition() == partition_for(b"dl", 2) and headers["trace"] == b"t-1"
    replayed_to = out["results"][0]["detail"]
    assert replayed_to == f"to {topics.receipts}[{copy.partition()}]@{copy.offset()} (rekeyed)"
    rc, listing, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "list", "--error-class", "misrouted")
    assert listing["dead_letters"][0]["replayed"]["replayed_to"] == {
        "topic": topics.receipts, "partition": copy.partition(), "offset": copy.offset()}


def test_replay_requires_a_selection(kafka, capsys, tmp_path):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    setup_topics(cfg, partitions=2)
    rc, _, err = run_cli(capsys, cfg, tmp_path, "dead-letters", "replay", as_json=False)
    assert rc == 2 and "--all" in err


def test_a_concurrent_replay_is_fenced_and_the_record_is_reproduced_once(kafka):
    """Two operators replay the same dead letter: the one that started last fences the other,
    whose transaction then fails; the copy exists once."""
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    setup_topics(cfg, partitions=2)
    spec = make_group("race", 2, seed=8)
    feeder = CoordinateFeeder(kafka.bootstrap, topics)
    feeder.send(topics.receipts, b"race", feeder.receipt_codec.encode(spec.receipts[0]),
                partition=1 - partition_for(b"race", 2))
    feeder.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: read_all(kafka.bootstrap, topics.dead_letter, timeout=2), 60, "the dead letter")
    codecs = build_codecs(cfg)
    first, second = (PartitionReader(cfg, "race-a"), PartitionReader(cfg, "race-b"))
    a = Replayer(cfg, first, codecs, log_topic=f"{topics.dead_letter}.replays")
    b = Replayer(cfg, second, codecs, log_topic=f"{topics.dead_letter}.replays")
    a.prepare()
    views, _ = find(cfg, first, Filters())
    (view,) = views
    assert a.plan(view)[0] == "ready"
    b.prepare()                                         # fences a
    status, _, target = b.plan(view)
    b.replay(view, target)
    with pytest.raises(KafkaException):
        a.replay(view, a.plan(view)[2])
    first.close()
    second.close()
    assert len(_receipts_of(kafka, topics, b"race")) == 2           # the misrouted original + one copy
