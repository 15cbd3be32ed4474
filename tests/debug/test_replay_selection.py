"""``dead-letters replay`` on a real broker and stage: ``--key`` selects what ``list --key`` shows
(the garbage record keyed by the group too, which is refused with its reason); a record of
a group the ledger says is published is refused with the reason (the stage would count the copy
late), and ``--into-published`` re-produces it with a warning, which the stage then skips."""

from __future__ import annotations

from stage.wire import AvroCodec
from stage.wire.partitioner import partition_for
from tests.debug.helpers import CoordinateFeeder, run_cli
from tests.integration.harness import RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics

SUMMARY = AvroCodec("GroupSummary")
GARBAGE = b"\x00not avro"


def _summaries(kafka, topics, group_id: str) -> list[dict]:
    values = [SUMMARY.decode(m.value()) for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    return [v for v in values if v["group_id"] == group_id]


def _misrouted_group(kafka, topics, group_id: str, *, seed: int, garbage: bool):
    """Rollout 1's receipt keyed right but produced to the wrong partition (a producer with the
    wrong partitioner); optionally a garbage record keyed by the group."""
    spec = make_group(group_id, 2, seed=seed)
    key = group_id.encode()
    home = partition_for(key, 2)
    feeder = CoordinateFeeder(kafka.bootstrap, topics)
    feeder.staged(spec)
    feeder.receipts(spec, spec.receipts[:1])
    feeder.send(topics.receipts, key, feeder.receipt_codec.encode(spec.receipts[1]), partition=1 - home)
    if garbage:
        feeder.send(topics.receipts, key, GARBAGE, partition=home)
    feeder.flush()
    return feeder, home


def test_key_selects_what_list_shows_and_refuses_what_cannot_be_replayed(kafka, capsys, tmp_path):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=120_000)   # waits for the replay
    setup_topics(cfg, partitions=2)
    feeder, home = _misrouted_group(kafka, topics, "sel", seed=11, garbage=True)
    with RunningStage(cfg) as stage:
        stage.wait(lambda: len(read_all(kafka.bootstrap, topics.dead_letter, timeout=2)) >= 2, 60,
                   "the misrouted receipt and the garbage record dead-lettered")
        rc, listing, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "list", "--key", "sel")
        assert rc == 0 and sorted(d["error_class"] for d in listing["dead_letters"]) == ["misrouted", "undecodable"]

        rc, out, err = run_cli(capsys, cfg, tmp_path, "dead-letters", "replay", "--key", "sel")
        assert rc == 1, (out, err)      # the garbage record is refused
        assert out["counts"] == {"replayed": 1, "would_replay": 0, "already_replayed": 0, "refused": 1}
        by_class = {r["error_class"]: r for r in out["results"]}
        assert by_class["misrouted"]["detail"].startswith(f"to {topics.receipts}[{home}]@")
        assert by_class["undecodable"]["status"] == "refused" and "does not decode" in by_class["undecodable"]["detail"]
        stage.wait(lambda: _summaries(kafka, topics, "sel"), 60, "the group's publication")
    (summary,) = _summaries(kafka, topics, "sel")
    assert summary["outcome"] == "complete" and summary["valid_rows"] == 2


def test_key_also_finds_a_record_of_the_group_under_another_key(kafka, capsys, tmp_path):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=120_000)
    setup_topics(cfg, partitions=2)
    spec = make_group("owner", 2, seed=12)
    feeder = CoordinateFeeder(kafka.bootstrap, topics)
    feeder.staged(spec)
    feeder.receipts(spec, spec.receipts[:1])
    feeder.send(topics.receipts, b"someone-else", feeder.receipt_codec.encode(spec.receipts[1]))
    feeder.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: read_all(kafka.bootstrap, topics.dead_letter, timeout=2), 60, "the dead letter")
        rc, listing, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "list", "--key", "owner")
        assert rc == 0 and listing["matched"] == 1 and listing["dead_letters"][0]["key"] == "someone-else"
        rc, out, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "replay", "--key", "owner", "--rekey")
        assert rc == 0 and out["counts"]["replayed"] == 1 and out["results"][0]["detail"].endswith("(rekeyed)")
        stage.wait(lambda: _summaries(kafka, topics, "owner"), 60, "the group's publication")


def test_replay_into_a_published_group_is_refused_unless_asked_and_then_warned(kafka, capsys, tmp_path):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=2_000)   # published at its deadline
    setup_topics(cfg, partitions=2)
    feeder, home = _misrouted_group(kafka, topics, "late", seed=13, garbage=False)
    with RunningStage(cfg) as stage:
        stage.wait(lambda: _summaries(kafka, topics, "late"), 60, "publication at the deadline")
        (summary,) = _summaries(kafka, topics, "late")
        assert summary["outcome"] != "complete" and summary["valid_rows"] == 1
        receipts_before = len(read_all(kafka.bootstrap, topics.receipts))

        for dry in ((), ("--dry-run",)):
            rc, out, _ = run_cli(capsys, cfg, tmp_path, "dead-letters", "replay", "--key", "late", *dry)
            assert rc == 1 and out["counts"]["refused"] == 1, out
            detail = out["results"][0]["detail"]
            assert "group 'late' was already published at" in detail and f"ledger {topics.stage_ledger}[{home}]@" in detail
            assert "count a copy as a late record" in detail and "--into-published" in detail
        assert len(read_all(kafka.bootstrap, topics.receipts)) == receipts_before     # nothing produced

        rc, out, err = run_cli(capsys, cfg, tmp_path, "dead-letters", "replay", "--key", "late", "--into-published")
        assert rc == 0 and out["counts"]["replayed"] == 1, out
        assert "warning: " in err and "group 'late' was already published at" in err
        assert "re-produced anyway (--into-published)" in out["results"][0]["warning"]
        stage.wait(lambda: stage.runtime.stats.count("records_skipped", topic=topics.receipts, reason="late") >= 1,
                   60, "the copy counted as late")
    assert len(_summaries(kafka, topics, "late")) == 1                             # never published again
