"""The per-partition join: readiness, deadlines without traffic, late/replayed records, and the
commit watermark (never past a record an unpublished group still needs)."""

import pytest

from stage.buffer import (
    ADDED, COMPLETE, CONFLICT, DEADLINE, DUPLICATE, LATE, REPLAYED, ManualClock, PartitionBuffer,
    Position, ReceiptItem, StagedItem,
)

R, S = "receipts", "staged"


def buffer(timeout_ms=1000, retention_ms=5000):
    return PartitionBuffer(0, receipts_topic=R, staged_topic=S, group_timeout_ms=timeout_ms,
                           late_retention_ms=retention_ms)


def receipt(group, index, offset, *, keys=(), size=2, ts=0, missing=False):
    body = None if missing else {"manifest": [{"staging_key": k} for k in keys]}
    return ReceiptItem(group_id=group, rollout_id=f"{group}-r{index}", rollout_index=index,
                       group_size=size, prompt_idx=0, reward=1.0, receipt=body,
                       position=Position(R, 0, offset, ts), nbytes=100)


def staged(group, key, offset, ts=0, nbytes=1000):
    return StagedItem(group_id=group, staging_key=key, payload=None,
                      position=Position(S, 0, offset, ts), nbytes=nbytes)


def test_group_ready_only_when_all_receipts_and_named_rows_arrived():
    clock = ManualClock(10_000)
    b = buffer()
    assert b.add_staged(staged("g", "r0/a", 0, ts=10_000), clock.now_ms()) == ADDED
    assert b.add_receipt(receipt("g", 0, 0, keys=["r0/a"], ts=10_000), clock.now_ms()) == ADDED
    assert b.take_ready(clock.now_ms()) == ([], [])
    assert b.add_receipt(receipt("g", 1, 1, keys=["r1/a", "r1/b"], ts=10_000), clock.now_ms()) == ADDED
    b.add_staged(staged("g", "r1/a", 1, ts=10_000), clock.now_ms())
    assert b.take_ready(clock.now_ms())[0] == []        # r1/b still missing
    b.add_staged(staged("g", "r1/b", 2, ts=10_000), clock.now_ms())
    ready, orphans = b.take_ready(clock.now_ms())
    assert [(g.group_id, why) for g, why in ready] == [("g", COMPLETE)] and orphans == []
    assert b.take_ready(clock.now_ms()) == ([], [])     # taken once


def test_deadline_fires_from_record_timestamps_without_new_traffic():
    clock = ManualClock(50_000)
    b = buffer(timeout_ms=1000)
    b.add_receipt(receipt("g", 0, 0, ts=49_500), clock.now_ms())
    assert b.next_deadline_ms() == 50_500
    clock.advance(499)
    assert b.take_ready(clock.now_ms())[0] == []
    clock.advance(1)
    ready, _ = b.take_ready(clock.now_ms())
    assert [(g.group_id, why) for g, why in ready] == [("g", DEADLINE)]
    assert b.next_deadline_ms() is None


def test_future_producer_timestamp_does_not_extend_the_deadline():
    clock = ManualClock(1_000)
    b = buffer(timeout_ms=100)
    b.add_receipt(receipt("g", 0, 0, ts=9_999_999), clock.now_ms())
    assert b.next_deadline_ms() == 1_100


def test_orphan_staged_calls_expire_without_publication():
    clock = ManualClock(0)
    b = buffer(timeout_ms=10)
    b.add_staged(staged("lonely", "x/a", 0), 0)
    b.add_staged(staged("lonely", "x/b", 1), 0)
    clock.advance(10)
    ready, orphans = b.take_ready(clock.now_ms())
    assert ready == [] and [g.group_id for g in orphans] == ["lonely"]
    assert b.counts["orphan_groups_expired"] == 1 and b.counts["orphan_staged_expired"] == 2
    assert b.nbytes == 0 and b.open_groups == 0
    assert b.committable(S) == 2                         # the expired records are processed


def test_late_and_duplicate_and_conflicting_records():
    b = buffer()
    b.add_receipt(receipt("g", 0, 0, size=2), 0)
    assert b.add_receipt(receipt("g", 0, 1, size=2), 0) == DUPLICATE
    assert b.add_receipt(receipt("g", 1, 2, size=3), 0) == CONFLICT   # another N
    assert b.add_receipt(receipt("g", 5, 3, size=2), 0) == CONFLICT   # index out of range
    b.add_receipt(receipt("g", 1, 4, size=2), 0)
    (group, _), = b.take_ready(0)[0]
    assert b.add_staged(staged("g", "late/a", 9), 0) == LATE          # in flight
    b.mark_published("g", 0)
    assert b.add_receipt(receipt("g", 1, 10), 0) == LATE
    assert b.counts["receipt_late"] == 1 and b.counts["staged_late"] == 1


def test_watermark_holds_at_the_lowest_offset_of_unpublished_groups():
    b = buffer()
    b.add_receipt(receipt("a", 0, 5, size=1), 0)
    b.add_receipt(receipt("b", 0, 6, size=2), 0)
    b.add_staged(staged("b", "k", 40), 0)
    b.add_receipt(receipt("c", 0, 7, size=1), 0)
    assert b.committable(R) == 5 and b.committable(S) == 40
    ready = {g.group_id for g, _ in b.take_ready(0)[0]}
    assert ready == {"a", "c"}
    assert b.committable(R) == 5                         # in flight still holds the watermark
    b.mark_published("a", 0)
    assert b.committable(R) == 6                         # b (open) holds it now
    b.mark_published("c", 0)
    assert b.committable(R) == 6
    assert b.committable(R, committed=9) == 9            # never moves backwards


def test_watermark_is_one_past_the_last_record_when_nothing_is_open():
    b = buffer()
    assert b.committable(R) is None and b.committable(R, committed=3) == 3
    b.add_receipt(receipt("a", 0, 11, size=1), 0)
    b.take_ready(0)
    b.mark_published("a", 0)
    assert b.committable(R) == 12
    b.skip(R, 20)                                        # a dead-lettered record
    assert b.committable(R) == 21


def test_ledger_groups_are_replayed_not_republished_and_expire_after_retention():
    b = buffer(retention_ms=1000)
    b.load_published("g", {R: 3, S: 8}, published_at_ms=0)
    assert b.add_receipt(receipt("g", 0, 3), 10) == REPLAYED
    assert b.add_staged(staged("g", "k", 8), 10) == REPLAYED
    assert b.open_groups == 0
    assert b.expire_published({R: 4, S: 9}, now_ms=500) == []         # retention not over
    assert b.expire_published({R: 3, S: 9}, now_ms=5000) == []        # receipt 3 not committed
    assert b.expire_published({R: 4, S: 9}, now_ms=5000) == ["g"]
    assert "g" not in b.published


def test_release_puts_an_aborted_group_back():
    b = buffer()
    b.add_receipt(receipt("g", 0, 0, size=1), 0)
    (group, why), = b.take_ready(0)[0]
    b.release("g")
    assert [g.group_id for g, _ in b.take_ready(0)[0]] == ["g"]


def test_byte_accounting_follows_admission_and_publication():
    b = buffer()
    b.add_staged(staged("g", "k1", 0, nbytes=700), 0)
    b.add_receipt(receipt("g", 0, 0, keys=["k1"], size=1), 0)
    assert b.nbytes == 800
    b.add_staged(staged("g", "k1", 1, nbytes=700), 0)   # duplicate: not counted
    assert b.nbytes == 800
    b.take_ready(0)
    b.mark_published("g", 0)
    assert b.nbytes == 0


def test_missing_receipt_event_counts_as_arrived():
    b = buffer()
    b.add_receipt(receipt("g", 0, 0, size=2, missing=True), 0)
    b.add_receipt(receipt("g", 1, 1, size=2, keys=["k"]), 0)
    b.add_staged(staged("g", "k", 0), 0)
    assert [why for _, why in b.take_ready(0)[0]] == [COMPLETE]


@pytest.mark.parametrize("order", ["staged_first", "receipts_first"])
def test_arrival_order_does_not_matter(order):
    b = buffer()
    events = [("s", "k0"), ("s", "k1"), ("r", 0), ("r", 1)]
    if order == "receipts_first":
        events.reverse()
    for i, (kind, value) in enumerate(events):
        if kind == "s":
            b.add_staged(staged("g", value, i), 0)
        else:
            b.add_receipt(receipt("g", value, i, keys=[f"k{value}"]), 0)
    assert [why for _, why in b.take_ready(0)[0]] == [COMPLETE]


def test_groups_published_in_the_same_transaction_release_the_watermark():
    b = buffer()
    b.add_receipt(receipt("a", 0, 5, size=1), 0)
    b.add_receipt(receipt("b", 0, 6, size=2), 0)
    assert b.committable(R, excluding={"a"}) == 6
    assert b.committable(R, excluding={"a", "b"}) == 7
    assert b.committable(R) == 5


def test_deadline_waits_while_the_stage_catches_up_on_the_other_topic():
    # After downtime every deadline is in the past; receipts are read first. The group must not
    # fire before the staged-calls topic was read past its deadline (or to its end).
    clock = ManualClock(100_000)
    b = buffer(timeout_ms=1000)
    b.add_receipt(receipt("g", 0, 0, keys=["k"], size=1, ts=10_000), clock.now_ms())
    b.add_receipt(receipt("h", 0, 1, keys=["hk"], size=1, ts=20_000), clock.now_ms())
    lagging = {R: clock.now_ms(), S: -1}   # receipts read to their end now; staged calls not
    assert b.take_ready(clock.now_ms(), lagging) == ([], [])
    b.add_staged(staged("x", "other", 0, ts=10_500), clock.now_ms())       # still before 11_000
    assert b.take_ready(clock.now_ms(), lagging)[0] == []
    b.add_staged(staged("g", "k", 1, ts=10_900), clock.now_ms())           # completes g
    assert [g.group_id for g, _ in b.take_ready(clock.now_ms(), lagging)[0]] == ["g"]
    b.add_staged(staged("y", "z", 2, ts=30_000), clock.now_ms())           # read past h's deadline
    ready, _ = b.take_ready(clock.now_ms(), lagging)
    assert [(g.group_id, why) for g, why in ready] == [("h", DEADLINE)]


def test_caught_up_topics_let_deadlines_fire_with_no_traffic():
    b = buffer(timeout_ms=1000)
    b.add_receipt(receipt("g", 0, 0, keys=["k"], size=1, ts=0), 0)
    assert b.take_ready(5000, {R: 5000, S: -1})[0] == []
    assert [why for _, why in b.take_ready(5000, {R: 5000, S: 5000})[0]] == [DEADLINE]


def test_read_to_the_end_before_the_deadline_does_not_count():
    # An end offset asked for before the deadline says nothing about records produced between
    # that moment and the deadline (a failover may still hold them in a producer).
    b = buffer(timeout_ms=1000)
    b.add_receipt(receipt("g", 0, 0, keys=["k"], size=1, ts=0), 0)
    assert b.take_ready(5000, {R: 999, S: 4000})[0] == []
    assert [why for _, why in b.take_ready(5000, {R: 1000, S: 4000})[0]] == [DEADLINE]


def test_forced_deadlines_fire_without_the_input_being_read():
    b = buffer(timeout_ms=1000)
    b.add_receipt(receipt("g", 0, 0, keys=["k"], size=1, ts=0), 0)
    b.add_receipt(receipt("h", 0, 1, keys=["hk"], size=1, ts=3000), 3000)
    assert b.take_ready(9000, {}, force_before_ms=999)[0] == []
    ready, _ = b.take_ready(9000, {}, force_before_ms=1000)
    assert [g.group_id for g, _ in ready] == ["g"]          # h's deadline (4000) is not forced


# --- duplicates and conflicts: same identity, same or other content -------------------------


def test_a_receipt_repeated_with_other_content_is_a_conflict_naming_what_differs():
    """It was counted as a duplicate and skipped: neither dead-lettered nor reported."""
    from dataclasses import replace
    b = buffer()
    first = receipt("g", 0, 0, keys=["r0/a"])
    assert b.add_receipt(first, 0) == ADDED
    assert b.add_receipt(replace(first, position=Position(R, 0, 1, 0)), 0) == DUPLICATE
    other = replace(first, reward=0.25, position=Position(R, 0, 2, 0))
    assert b.add_receipt(other, 0) == CONFLICT
    assert b.last_conflict == ("conflicts with group g: rollout_index 0 received twice with different "
                               "content: reward 0.25 != 1.0 (the new copy's value first; the first copy, "
                               "kept, at receipts[0]@0)")
    deep = replace(first, receipt={"manifest": [{"staging_key": "r0/b"}]}, position=Position(R, 0, 3, 0))
    assert b.add_receipt(deep, 0) == CONFLICT
    assert "receipt.manifest[0].staging_key 'r0/b' != 'r0/a'" in b.last_conflict
    assert b.groups["g"].receipts[0] is first                         # the first copy stays
    assert (b.counts["receipt_duplicate"], b.counts["receipt_conflict"]) == (1, 2)


def test_receipts_that_differ_only_in_label_order_or_a_nan_nothing_checks_are_duplicates():
    from dataclasses import replace
    b = buffer()
    first = replace(receipt("g", 0, 0), labels=(("a", "x"), ("b", "y")),
                    receipt={"manifest": [], "reward": float("nan")})
    b.add_receipt(first, 0)
    again = replace(first, labels=(("b", "y"), ("a", "x")), receipt={"manifest": [], "reward": float("nan")},
                    position=Position(R, 0, 1, 0))
    assert b.add_receipt(again, 0) == DUPLICATE


def test_a_staged_call_repeated_with_other_content_is_a_conflict_naming_the_field():
    from dataclasses import replace
    b = buffer()
    names = ("staging_key", "digest", "media")
    first = replace(staged("g", "r0/a", 0), fingerprint=(names, ("r0/a", "ab" * 32, None)))
    b.add_staged(first, 0)
    assert b.add_staged(replace(first, position=Position(S, 0, 1, 0)), 0) == DUPLICATE
    other = replace(first, fingerprint=(names, ("r0/a", "cd" * 32, None)), position=Position(S, 0, 2, 0))
    assert b.add_staged(other, 0) == CONFLICT
    assert b.last_conflict.startswith("conflicts with group g: staging_key 'r0/a' staged twice with "
                                      "different content: digest 'cdcdcd")
    media = replace(first, fingerprint=(names, ("r0/a", "ab" * 32, {"imgs": b"\x01"})),
                    position=Position(S, 0, 3, 0))
    assert b.add_staged(media, 0) == CONFLICT and "media differs" in b.last_conflict
    assert b.groups["g"].staged["r0/a"] is first and b.counts["staged_conflict"] == 2


def test_staged_copies_are_compared_through_their_decode_fingerprint():
    """What the decoder keeps (stage.decode.staged_fingerprint): every field but the digested
    tensor columns, so the comparison does not need the payload the buffer holds."""
    import numpy as np
    from stage.wire import pack_tensor

    value, decoded = _one_staged_call()

    def item(record, offset):
        out = decoded(record, offset)
        out.payload = None                       # the buffer need not hold the payload to compare
        return out

    b = buffer()
    assert b.add_staged(item(value, 0), 0) == ADDED
    wider = dict(value, token_ids_delta=pack_tensor(np.array([1, 2, 3], dtype=np.uint64)))
    assert b.add_staged(item(wider, 1), 0) == DUPLICATE   # same tokens, same digest, other dtype
    forged = dict(value, digest="0" * 64)
    assert b.add_staged(item(forged, 2), 0) == CONFLICT
    assert "digest '0000" in b.last_conflict
    assert b.add_staged(item(dict(value, extras_metadata_json='{"a":1}'), 3), 0) == CONFLICT
    assert "extras_metadata_json" in b.last_conflict


def test_a_staged_copy_with_other_tokens_under_the_same_digest_is_a_conflict():
    """The fingerprint leaves the digested columns out; the tensors themselves are compared when
    both copies hold them (by value: another wire dtype of the same tokens is a duplicate)."""
    import numpy as np
    from stage.wire import pack_tensor

    value, item = _one_staged_call()

    b = buffer()
    assert b.add_staged(item(value, 0), 0) == ADDED
    wider = dict(value, token_ids_delta=pack_tensor(np.array([1, 2, 3], dtype=np.uint64)))
    assert b.add_staged(item(wider, 1), 0) == DUPLICATE
    tampered = dict(value, token_ids_delta=pack_tensor(np.array([1, 2, 4], dtype=np.uint32)))
    assert b.add_staged(item(tampered, 2), 0) == CONFLICT
    assert "token_ids_delta differs (same digest" in b.last_conflict


def _one_staged_call():
    """A StagedCall value the SDK would send, and item(record, offset): it decoded by the
    intake's decoder (stage.decode.staged_item) at that offset."""
    from stage.client import staged_call_from_record
    from stage.contract.producer import RolloutBuilder
    from stage.decode import staged_item
    from stage.wire import AvroCodec

    codec = AvroCodec("StagedCall")
    call = RolloutBuilder("r0").stage("c1", parent_call_id=None, prompt_delta=[1, 2], generated=[3],
                                     generated_logprobs=[-0.5], weight_version=1).record

    def item(record, offset):
        data = codec.encode(record)
        return staged_item(codec.decode(data), Position(S, 0, offset, 0), len(data))

    return staged_call_from_record("g", call), item
