"""Staleness control without a broker: groups whose weight versions are too old for the
policy are skipped or held, counted by reason, never silently; a skipped group counts as
consumed for the checkpoint position, a held one holds the position until taken."""

from __future__ import annotations

import pytest

from stage.client import Staleness
from stage.client.stream import GroupStream
from tests.client.rows import group_rows

TP = ("rows", 0)


def stream_with(groups, staleness: Staleness, version: int | None = 10) -> GroupStream:
    """``groups``: (group id, min weight version, max weight version, has valid rows)."""
    stream = GroupStream(staleness=staleness, remember_records=0)
    if version is not None:
        stream.weight_version = version
    offset = 0
    for gid, low, high, valid in groups:
        for record, raw in group_rows(gid, weight_version=low, max_wv=high, valid=valid):
            stream.offer("rows", TP, offset, record, raw)
            offset += 1
    stream.end_batch()
    return stream


def handed_out(stream: GroupStream) -> list[str]:
    out = []
    while (group := stream.next_group()) is not None:
        out.append(group.group_id)
    return out


def test_groups_older_than_the_lag_are_skipped_and_counted_by_reason():
    stream = stream_with([("old", 7, 9, True), ("edge", 8, 8, True), ("new", 10, 10, True),
                          ("empty", 0, 0, False)], Staleness(max_weight_version_lag=2))
    assert handed_out(stream) == ["edge", "new"]          # 10 - 2 = 8 is the oldest accepted
    assert stream.staleness.counts == {"fresh": 2, "skipped/weight_version_lag": 1,
                                       "skipped/weight_version_lag/fallback": 1}
    assert stream.counts["handed_out"] == 2
    # skipped groups are consumed: the position passes them, a restart does not bring them back
    (part,) = stream.position().partitions
    assert part.offset == 12


def test_the_check_follows_the_policy_version_when_the_group_is_handed_out():
    stream = stream_with([("a", 5, 5, True), ("b", 5, 5, True)], Staleness(max_weight_version_lag=1),
                         version=6)
    assert stream.next_group().group_id == "a"
    stream.weight_version = 7                              # a weight update between two steps
    assert stream.next_group() is None
    assert stream.staleness.counts["skipped/weight_version_lag"] == 1


def test_a_minimum_weight_version_and_groups_ahead_of_the_policy():
    stream = stream_with([("before", 2, 3, True), ("ok", 3, 4, True), ("ahead", 9, 12, True)],
                         Staleness(min_weight_version=3))
    assert handed_out(stream) == ["ok", "ahead"]
    assert stream.staleness.counts == {"skipped/min_weight_version": 1, "fresh": 2, "ahead_of_policy": 1}


def test_held_groups_hold_the_position_until_the_trainer_takes_them():
    stream = stream_with([("old", 1, 1, True), ("new", 10, 10, True)],
                         Staleness(max_weight_version_lag=0, on_stale="hold"))
    assert handed_out(stream) == ["new"]
    assert [g.group_id for g in stream.held] == ["old"]
    assert stream.staleness.counts["held/weight_version_lag"] == 1
    assert stream.position().partitions[0].offset == 0     # "old" (offsets 0..2) is not consumed
    assert [g.group_id for g in stream.take_held()] == ["old"] and not stream.held
    assert stream.position().partitions[0].offset == 6


def test_a_lag_without_a_policy_version_is_an_error_not_a_guess():
    stream = stream_with([("a", 1, 1, True)], Staleness(max_weight_version_lag=1), version=None)
    with pytest.raises(RuntimeError, match="set_weight_version"):
        stream.next_group()
    stream.weight_version = 1                              # the trainer sets it and goes on
    assert stream.next_group().group_id == "a"


@pytest.mark.parametrize("kwargs", [{"on_stale": "drop"}, {"max_weight_version_lag": -1},
                                    {"min_weight_version": 1.5}, {"max_weight_version_lag": True}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Staleness(**kwargs)
