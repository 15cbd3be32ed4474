"""Group-level receipt fields (established by the first receipt, contradictions refused with the
field named), per-rollout result_stats summed over the group, and the group's earliest timestamp."""

import math

import pytest

from stage.buffer import (
    ADDED, CONFLICT, DEADLINE, DUPLICATE, ManualClock, PartitionBuffer, Position, ReceiptItem,
    StagedItem,
)

R, S = "receipts", "staged"


def buffer(timeout_ms=1000):
    return PartitionBuffer(0, receipts_topic=R, staged_topic=S, group_timeout_ms=timeout_ms,
                           late_retention_ms=5000)


def receipt(index, offset, *, group="g7", size=4, ts=0, **fields):
    base = dict(prompt_idx=7, loss_multiplier=0.5, fallback_weight_version=3,
                labels=(("harness", "h"), ("agent", "a")), result_stats=())
    base.update(fields)
    return ReceiptItem(group_id=group, rollout_id=f"{group}-r{index}", rollout_index=index,
                       group_size=size, reward=1.0, receipt=None, position=Position(R, 0, offset, ts),
                       nbytes=100, **base)


@pytest.mark.parametrize("field, value, text", [
    ("prompt_idx", 3, "prompt_idx 3 != 7"),
    ("loss_multiplier", 0.25, "loss_multiplier 0.25 != 0.5"),
    # exact double equality: one ulp off is another value
    ("loss_multiplier", math.nextafter(0.5, 1.0), "loss_multiplier 0.5000000000000001 != 0.5"),
    ("fallback_weight_version", 4, "fallback_weight_version 4 != 3"),
    ("labels", (("harness", "h"),),
     "labels [('harness', 'h')] != [('agent', 'a'), ('harness', 'h')]"),
    ("labels", (("harness", "h"), ("agent", "a"), ("agent", "b")),
     "labels [('agent', 'a'), ('agent', 'b'), ('harness', 'h')] != [('agent', 'a'), ('harness', 'h')]"),
])
def test_a_receipt_contradicting_a_group_level_field_is_refused_with_the_field_named(field, value, text):
    b = buffer()
    assert b.add_receipt(receipt(0, 10), 0) == ADDED
    assert b.add_receipt(receipt(1, 11, **{field: value}), 0) == CONFLICT
    assert b.last_conflict == f"conflicts with group g7: {text} (first receipt rollout_index 0)"
    group = b.groups["g7"]
    assert list(group.receipts) == [0] and group.nbytes == 100      # it never joined
    assert b.counts["receipt_conflict"] == 1
    assert b.add_receipt(receipt(1, 12), 0) == ADDED                 # the index is still free
    fields = group.fields
    assert (fields.prompt_idx, fields.loss_multiplier, fields.fallback_weight_version) == (7, 0.5, 3)
    assert fields.labels == (("harness", "h"), ("agent", "a"))


def test_the_first_receipt_read_establishes_the_fields_whatever_its_index():
    b = buffer()
    b.add_receipt(receipt(2, 0, prompt_idx=9), 0)
    assert b.add_receipt(receipt(0, 1), 0) == CONFLICT
    assert b.last_conflict == ("conflicts with group g7: prompt_idx 7 != 9 "
                               "(first receipt rollout_index 2)")


def test_group_size_and_index_conflicts_name_the_values():
    b = buffer()
    b.add_receipt(receipt(0, 0, size=2), 0)
    assert b.add_receipt(receipt(1, 1, size=3), 0) == CONFLICT
    assert b.last_conflict == "conflicts with group g7: group_size 3 != 2 (first receipt rollout_index 0)"
    assert b.add_receipt(receipt(5, 2, size=2), 0) == CONFLICT
    assert b.last_conflict == "conflicts with group g7: rollout_index 5 out of range for group_size 2"


def test_a_conflicting_duplicate_is_a_conflict_not_a_silent_duplicate():
    b = buffer()
    b.add_receipt(receipt(0, 0), 0)
    assert b.add_receipt(receipt(0, 1), 0) == DUPLICATE
    assert b.add_receipt(receipt(0, 2, prompt_idx=8), 0) == CONFLICT


def test_labels_are_a_set_order_and_repeats_do_not_conflict():
    b = buffer()
    b.add_receipt(receipt(0, 0, labels=(("harness", "h"), ("agent", "a"), ("harness", "h"))), 0)
    assert b.add_receipt(receipt(1, 1, labels=(("agent", "a"), ("harness", "h"))), 0) == ADDED
    assert b.groups["g7"].fields.labels == (("harness", "h"), ("agent", "a"))   # repeats dropped


def test_result_stats_are_summed_over_the_groups_receipts_in_rollout_order():
    stats = {0: (("score", 1.0, 1), ("turns", 3.0, 1)), 1: (("score", 2.0, 1),),
             2: (("score", 3.0, 1), ("turns", 5.0, 2)), 3: (("score", 4.0, 1),)}
    outcomes = []
    for arrival in ([0, 1, 2, 3], [3, 1, 0, 2]):
        b = buffer()
        for offset, i in enumerate(arrival):
            assert b.add_receipt(receipt(i, offset, result_stats=stats[i]), 0) == ADDED
        outcomes.append(b.groups["g7"].result_stats())
    assert outcomes[0] == (("score", 10.0, 4), ("turns", 8.0, 3))
    assert outcomes[1] == outcomes[0]


def test_float_sums_do_not_depend_on_arrival_order():
    # (0.1 + 0.2) + 0.3 != 0.1 + (0.2 + 0.3): the group adds in rollout order, always.
    values = {0: 0.1, 1: 0.2, 2: 0.3}
    sums = set()
    for arrival in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        b = buffer()
        for offset, i in enumerate(arrival):
            b.add_receipt(receipt(i, offset, size=3, result_stats=(("x", values[i], 1),)), 0)
        sums.add(b.groups["g7"].result_stats())
    assert sums == {(("x", (0.1 + 0.2) + 0.3, 3),)}


def test_a_group_names_a_bounded_number_of_result_fields():
    from stage.buffer import MAX_GROUP_RESULT_FIELDS
    b = buffer()
    half = MAX_GROUP_RESULT_FIELDS // 2
    first = tuple((f"a{i}", 1.0, 1) for i in range(half))
    assert b.add_receipt(receipt(0, 0, result_stats=first), 0) == ADDED
    fits = tuple((f"b{i}", 1.0, 1) for i in range(MAX_GROUP_RESULT_FIELDS - half))
    assert b.add_receipt(receipt(1, 1, result_stats=fits), 0) == ADDED
    assert b.add_receipt(receipt(2, 2, result_stats=first + (("c", 1.0, 1),)), 0) == CONFLICT
    assert b.last_conflict == (f"conflicts with group g7: result_stats would name "
                               f"{MAX_GROUP_RESULT_FIELDS + 1} distinct fields across the group, "
                               f"more than {MAX_GROUP_RESULT_FIELDS}")
    assert b.add_receipt(receipt(2, 3, result_stats=first), 0) == ADDED       # known fields


def test_first_timestamp_is_the_earliest_record_and_the_deadline_follows_it():
    clock = ManualClock(100_000)
    b = buffer(timeout_ms=1000)
    b.add_receipt(receipt(0, 0, size=2, ts=99_500), clock.now_ms())
    group = b.groups["g7"]
    assert (group.first_timestamp_ms, group.deadline_ms) == (99_500, 100_500)
    # a staged call stamped earlier, read later (the other topic lagged)
    b.add_staged(StagedItem("g7", "k", None, Position(S, 0, 0, 99_000), 10), clock.now_ms())
    assert (group.first_timestamp_ms, group.deadline_ms) == (99_000, 100_000)
    assert (group.last_timestamp_ms, b.next_deadline_ms()) == (99_500, 100_000)
    ready, _ = b.take_ready(clock.now_ms())
    assert [(g.group_id, why) for g, why in ready] == [("g7", DEADLINE)]
    assert b.take_ready(clock.now_ms() + 10_000) == ([], [])     # the stale later entry is skipped


def test_a_future_timestamp_is_published_as_is_but_never_extends_the_deadline():
    b = buffer(timeout_ms=100)
    b.add_receipt(receipt(0, 0, size=2, ts=9_999_999), 1_000)
    group = b.groups["g7"]
    assert (group.first_timestamp_ms, group.deadline_ms) == (9_999_999, 1_100)
    b.add_receipt(receipt(1, 1, size=2, ts=5_000), 2_000)    # earlier stamp, read later
    assert (group.first_timestamp_ms, group.deadline_ms) == (5_000, 1_100)
