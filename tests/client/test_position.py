"""The reader's checkpointable position without a broker: a trainer that checkpoints its train
state with ``position()`` and restarts from it after crashes at arbitrary points trains every
group exactly once, whatever the interleaving of groups across the read position."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage.client import CanonicalReader, ReadPosition
from stage.client.stream import GroupStream
from tests.client.rows import group_rows, interleaved_log

TOPIC = "rows"


def offer_all(stream: GroupStream, log, start: int = 0, stop: int | None = None, partition: int = 0) -> None:
    for offset in range(start, len(log) if stop is None else stop):
        _, record, raw = log[offset]
        stream.offer("rows", (TOPIC, partition), offset, record, raw)
    stream.end_batch()


def drain(stream: GroupStream) -> list[str]:
    out = []
    while (group := stream.next_group()) is not None:
        out.append(group.group_id)
    return out


def test_a_group_straddling_the_position_is_not_handed_out_again_nor_left_pending():
    a, b = group_rows("a"), group_rows("b")
    # a0 b0 a1 a2 b1 b2: a completes at offset 3 while b (from offset 1) is still assembling
    log = [("a", *a[0]), ("b", *b[0]), ("a", *a[1]), ("a", *a[2]), ("b", *b[1]), ("b", *b[2])]
    first = GroupStream(remember_records=0)
    offer_all(first, log, 0, 4)
    assert drain(first) == ["a"]
    position = first.position()
    (part,) = position.partitions
    assert (part.offset, dict(part.handed_out)) == (1, {"a": 3})   # b holds offset 1, a reaches 3

    resumed = GroupStream(remember_records=0)
    resumed.restore(ReadPosition.from_dict(json.loads(json.dumps(position.to_dict()))))
    offer_all(resumed, log, part.offset)
    assert drain(resumed) == ["b"]
    assert resumed.counts["replayed"] == 2 and not resumed.assembler.pending
    (after,) = resumed.position().partitions
    assert (after.offset, dict(after.handed_out)) == (6, {})   # nothing left to remember


def test_a_duplicate_read_after_the_group_is_covered_by_the_position():
    a, b = group_rows("a"), group_rows("b")
    log = [("a", *a[0]), ("a", *a[1]), ("a", *a[2]), ("b", *b[0]), ("a", *a[1])]   # a1 again at 4
    stream = GroupStream(remember_records=0)
    offer_all(stream, log)
    assert drain(stream) == ["a"] and stream.counts["duplicates"] == 1
    (part,) = stream.position().partitions
    # b holds offset 3; a's copy at 4 lies above it, so a must be remembered (else a restarted
    # reader would start a partial a there that never completes)
    assert (part.offset, dict(part.handed_out)) == (3, {"a": 4})


def test_a_group_published_again_after_the_position_is_dropped_after_a_restart_too():
    a, b = group_rows("a"), group_rows("b")
    log = [("a", *r) for r in a] + [("b", *r) for r in b] + [("a", *r) for r in a]  # a again at 6..8
    first = GroupStream(remember_records=5)
    offer_all(first, log, 0, 6)
    assert drain(first) == ["a", "b"]
    position = first.position()
    assert dict(position.partitions[0].handed_out) == {"a": 2, "b": 5}   # a: 4 records below 6
    resumed = GroupStream(remember_records=5)
    resumed.restore(position)
    offer_all(resumed, log, 6)
    assert drain(resumed) == [] and resumed.counts["replayed"] == 3
    first.tracker.remember_records = 2                   # a now lies beyond the window
    narrow = first.position()
    assert dict(narrow.partitions[0].handed_out) == {"b": 5}
    forgetful = GroupStream()
    forgetful.restore(narrow)
    offer_all(forgetful, log, 6)
    assert drain(forgetful) == ["a"]                     # so its copy is a new group


def test_groups_not_yet_handed_out_and_held_groups_hold_the_position():
    log = [(g, *row) for g in ("a", "b") for row in group_rows(g)]
    stream = GroupStream(remember_records=0)
    offer_all(stream, log)
    assert stream.position().partitions[0].offset == 0       # both complete, none handed out
    assert stream.next_group().group_id == "a"
    (part,) = stream.position().partitions
    assert (part.offset, dict(part.handed_out)) == (3, {})


def test_an_incomplete_group_far_behind_is_abandoned_counted_and_releases_the_position():
    a = group_rows("a")
    log = [("a", *a[0])] + [(g, *row) for i in range(4) for g in [f"f{i}"] for row in group_rows(g)]
    stream = GroupStream(max_pending_records=10)
    offer_all(stream, log)
    assert drain(stream) == ["f0", "f1", "f2", "f3"]
    assert stream.counts["abandoned"] == 1 and "a" not in stream.assembler.pending
    assert stream.position().partitions[0].offset == len(log)
    stream.offer("rows", (TOPIC, 0), len(log), *a[1])        # a late row of it: counted
    assert stream.counts["late"] == 1 and not stream.assembler.pending


@pytest.mark.parametrize("data, error", [
    ({"version": 2, "partitions": []}, "format version 1"),
    ({"version": 1, "partitions": [{"topic": "", "partition": 0, "offset": 0}]}, "topic"),
    ({"version": 1, "partitions": [{"topic": "t", "partition": -1, "offset": 0}]}, "partition"),
    ({"version": 1, "partitions": [{"topic": "t", "partition": 0, "offset": "7"}]}, "offset"),
    ({"version": 1, "partitions": [{"topic": "t", "partition": 0, "offset": 9, "handed_out": {"g": -3}}]},
     "handed_out"),
    ({"version": 1, "partitions": [{"topic": "t", "partition": 0, "offset": 1}] * 2}, "twice"),
])
def test_a_malformed_position_is_refused_with_what_is_wrong(data, error):
    with pytest.raises(ValueError, match=error):
        ReadPosition.from_dict(data)


def _trainer_run(seed: int, partitions: int = 2, groups: int = 12) -> tuple[list[str], list[str], int]:
    """A trainer over ``partitions`` interleaved logs that checkpoints (train state + position)
    and crashes at random points, restarting from its last checkpoint each time."""
    rng = random.Random(seed)
    ids = [f"g{i}" for i in range(groups)]
    logs = {p: interleaved_log(ids[p::partitions], rng, duplicate_rate=0.1) for p in range(partitions)}
    checkpoint = {"trained": [], "position": None}
    crashes = 0

    def start():
        stream = GroupStream(max_pending_records=40)
        if checkpoint["position"] is not None:
            stream.restore(ReadPosition.from_dict(json.loads(checkpoint["position"])))
        offsets = stream.tracker.next
        cursors = {p: offsets.get((TOPIC, p)) or 0 for p in logs}
        return stream, cursors, list(checkpoint["trained"])

    stream, cursors, trained = start()
    for _ in range(10_000):
        if all(cursors[p] >= len(logs[p]) for p in logs) and not stream.ready:
            break
        action = rng.random()
        if action < 0.45:
            p = rng.choice(list(logs))
            stop = min(len(logs[p]), cursors[p] + rng.randint(1, 4))
            for offset in range(cursors[p], stop):
                _, record, raw = logs[p][offset]
                stream.offer("rows", (TOPIC, p), offset, record, raw)
            stream.end_batch()
            cursors[p] = stop
        elif action < 0.8:
            group = stream.next_group()
            if group is not None:
                trained.append(group.group_id)
        elif action < 0.93:
            checkpoint = {"trained": list(trained), "position": json.dumps(stream.position().to_dict())}
        else:
            crashes += 1
            stream, cursors, trained = start()
    checkpoint = {"trained": list(trained), "position": None}
    return checkpoint["trained"], ids, crashes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_a_crashing_trainer_resumed_from_its_checkpoints_trains_every_group_exactly_once(seed):
    trained, ids, _ = _trainer_run(seed)
    assert sorted(trained) == sorted(ids)


def test_the_simulation_does_crash_and_resume():   # the property above is not vacuous
    assert sum(_trainer_run(seed)[2] for seed in range(5)) > 5


def test_start_from_is_refused_for_a_consumer_group_member_before_anything_connects():
    position = {"version": 1, "partitions": [{"topic": "rows", "partition": 0, "offset": 3}]}
    with pytest.raises(ValueError, match="assigns its partitions"):
        CanonicalReader("127.0.0.1:9", group_id="trainer", start_from=position)
    with pytest.raises(ValueError, match="format version"):
        CanonicalReader("127.0.0.1:9", start_from={"partitions": []})
