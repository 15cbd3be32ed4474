"""``dead-letters list|replay`` decisions without a broker (an in-memory PartitionReader): what
the replay log's records mean, which dead letters replay refuses, and that replay selects
what list shows."""

from __future__ import annotations

import json

import pytest

from stage.cli import _parser
from stage.config.model import StageConfig
from stage.debug.cli import _codecs, _filters
from stage.debug.deadletters import REPLAY_HEADER, Replayer, find, parse, read_markers, replay_log_topic
from stage.debug.kafka import Record
from stage.debug.text import dead_letter_lines
from stage.publish.deadletters import DeadLetter
from tests.integration.harness import make_group


class MemoryReader:
    """PartitionReader over {topic: [[(key, value, headers), ...] per partition]}."""

    def __init__(self, topics: dict) -> None:
        self.topics = topics

    def partitions(self, topic):
        return len(self.topics[topic]) if topic in self.topics else None

    def bounds(self, topic, partition):
        return 0, len(self.topics[topic][partition])

    def offset_at(self, topic, partition, timestamp_ms, default):
        return default

    def records(self, topic, partition):
        return [Record(topic, partition, offset, 1, key, value, tuple(headers))
                for offset, (key, value, headers) in enumerate(self.topics[topic][partition])]

    def scan(self, topic, partition, start, end, match=None):
        read = self.records(topic, partition)[start:end]
        return [r for r in read if match is None or match(r)], len(read)


CFG = StageConfig()
CODECS = _codecs(CFG)
DL = CFG.topics.dead_letter


def dead_letter(value, error_class, *, key=b"g", headers=(), source=None):
    letter = DeadLetter(source or CFG.topics.receipts, 0, 5, key, value, list(headers),
                        f"{error_class}: why", error_class)
    _, _, key, value, headers = letter.record(DL)
    return key, value, headers


def receipt_bytes(group_id="g") -> bytes:
    spec = make_group(group_id, 2, seed=3)
    return CODECS["ReceiptEvent"].encode(spec.receipts[0])


def planner(dead_letters, log=()) -> tuple[Replayer, MemoryReader]:
    reader = MemoryReader({DL: [list(dead_letters)], CFG.topics.receipts: [[], []],
                           replay_log_topic(CFG): [list(log)]})
    replayer = Replayer(CFG, reader, CODECS, log_topic=replay_log_topic(CFG), dry_run=True)
    replayer.prepare()
    return replayer, reader


def plans(replayer, reader):
    return [replayer.plan(parse(r))[:2] for r in reader.records(DL, 0)]


@pytest.mark.parametrize("value", [b"[1, 2]", b'"text"', b"7", b"null", b'{"replayed_to": [1]}'])
def test_a_replay_log_record_that_is_json_but_not_an_object_marks_without_killing_replay(value):
    """Issue 29 item 10: such a record raised AttributeError in every replay until compaction."""
    replayer, reader = planner([dead_letter(receipt_bytes(), "misrouted")],
                               log=[(f"{DL}/0/0".encode(), value, ())])
    ((status, detail),) = plans(replayer, reader)
    assert status == "already_replayed" and "unreadable record in the replay log" in detail
    markers = read_markers(reader, replay_log_topic(CFG))
    row = parse(reader.records(DL, 0)[0]).as_dict(markers[f"{DL}/0/0"])
    assert "unreadable record" in dead_letter_lines(row)


def test_a_readable_marker_still_names_where_the_copy_went():
    marker = {"replayed_to": {"topic": "in", "partition": 1, "offset": 9}}
    replayer, reader = planner([dead_letter(receipt_bytes(), "misrouted")],
                               log=[(f"{DL}/0/0".encode(), json.dumps(marker).encode(), ())])
    assert plans(replayer, reader) == [("already_replayed", "replayed before to in[1]@9")]


@pytest.mark.parametrize("error_class", ["invalid", "conflict"])
def test_records_the_stage_refused_for_their_content_are_not_re_produced(error_class):
    """Issue 29 item 10: an invalid or conflicting record decodes, so every `replay --all`
    re-produced it and the stage dead-lettered the copy again."""
    replayer, reader = planner([dead_letter(receipt_bytes(), error_class)])
    ((status, detail),) = plans(replayer, reader)
    assert status == "refused" and f"refused this record's content ({error_class}" in detail
    assert "dead-lettered again" in detail


def test_a_replayed_copy_dead_lettered_again_is_not_replayed_again():
    copy = dead_letter(receipt_bytes(), "misrouted", key=b"other",
                       headers=[(REPLAY_HEADER, f"{DL}/0/3".encode())])
    replayer, reader = planner([copy])
    replayer.rekey = True
    ((status, detail),) = plans(replayer, reader)
    assert status == "refused" and f"a copy replayed from {DL}/0/3" in detail


def test_a_misrouted_record_is_still_replayable():
    replayer, reader = planner([dead_letter(receipt_bytes(), "misrouted")])
    assert plans(replayer, reader)[0][0] == "would_replay"


def test_replay_key_selects_what_list_key_shows():
    """Issue 27 item 6: records produced with a wrong key are listed by `list --key KEY`, but
    `replay --key KEY` selected none of them (it wanted the value to name KEY) and exited 0."""
    wrong_key = dead_letter(receipt_bytes("g"), "misrouted", key=b"wrong")
    garbage = dead_letter(b"\x00junk", "undecodable", key=b"wrong")
    named = dead_letter(receipt_bytes("wrong"), "misrouted", key=b"third")
    unrelated = dead_letter(receipt_bytes("h"), "misrouted", key=b"h")
    reader = MemoryReader({DL: [[wrong_key, garbage, named, unrelated]]})
    selected = {}
    for command in ("list", "replay"):
        args = _parser().parse_args(["dead-letters", command, "--key", "wrong"])
        views, _ = find(CFG, reader, _filters(args), codecs=CODECS)
        selected[command] = [v.record.offset for v in views]
    assert selected["list"] == [0, 1, 2]
    assert selected["replay"] == selected["list"]
