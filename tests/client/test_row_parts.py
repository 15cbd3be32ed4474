"""Rows the stage published in parts (a row over its max_record_bytes), read back by the
trainer's GroupAssembler: parts are joined per copy of the row, never across copies."""

import pytest
import torch

from stage.client import GroupAssembler
from stage.finalize import ReassemblyConfig, pad_group
from stage.publish.records import encode_row
from stage.wire import AvroCodec
from tests.client.test_reader import ROWS, finalized_group


def split_group(cap=400, config=ReassemblyConfig(router_replay=True)):
    """finalized_group's rows (270, 440 and 142 bytes as one record) through the stage's
    encode_row with a small cap: the 14-token row is published in parts, the others whole."""
    group, _ = finalized_group(config)
    codec = AvroCodec("CanonicalRow", max_record_bytes=cap)
    return group, [encode_row(row, codec) for row in group.rows]


def other_copy(blobs: list[bytes]) -> list[tuple[dict, bytes]]:
    """Another copy of a split row: the same plain fields, other token ids (as a second
    publication of the group may hold), each part re-encoded."""
    out = []
    for blob in blobs:
        record = ROWS.decode(blob)
        ids = record["input_ids"]
        record["input_ids"] = dict(ids, data=bytes(b ^ 0x01 for b in ids["data"]))
        raw = ROWS.encode(record)
        out.append((ROWS.decode(raw), raw))
    return out


def feed(assembler, log):
    """Offer (record, raw) pairs at offsets 0.. of one partition; the groups completed."""
    return [g for offset, (record, raw) in enumerate(log)
            if (g := assembler.add_row(record, raw, ("rows", 0, offset))) is not None]


def test_encode_row_splits_only_what_exceeds_the_cap_and_each_part_fits():
    group, parts = split_group()
    assert [len(p) > 1 for p in parts] == [False, True, False]
    for blobs in parts:
        assert all(len(blob) <= 400 for blob in blobs)
        decoded = [ROWS.decode(blob) for blob in blobs]
        if len(blobs) > 1:
            assert [d["row_part"] for d in decoded] == [{"index": i, "count": len(blobs)}
                                                      for i in range(len(blobs))]
            assert {d["input_lengths"] for d in decoded} == {decoded[0]["input_lengths"]}
        else:
            assert decoded[0]["row_part"] is None


def test_rows_in_any_order_then_copies_reassemble_into_the_finalizers_rows():
    group, parts = split_group()
    log = [(ROWS.decode(b), b) for row in reversed(parts) for b in row]   # each row's parts in order
    log += log[:3]                                                         # then copies of them
    assembler = GroupAssembler()
    done = feed(assembler, log)
    assert len(done) == 1 and assembler.counts["duplicates"] == 3 and assembler.counts["conflicts"] == 0
    out = done[0]
    for row, want in zip(out.rows, group.rows):
        for name in ("input_ids", "generation_logprobs", "token_mask", "prompt_ids_for_adv", "routed_experts"):
            assert torch.equal(getattr(row, name), getattr(want, name)), name
    assert torch.equal(out.tensors()["routed_experts"], pad_group(group)["routed_experts"])
    assert out.records[0]["row_part"] is None          # the whole record, as one row would be


@pytest.mark.parametrize("with_position", [True, False])
def test_part_0_of_a_cut_copy_is_never_joined_with_the_parts_of_another_copy(with_position):
    """Issue 29 item 7: copy A's part 0 (its run cut: an aborted publication a broker shows),
    then copy B whole. Per-part de-duplication merged A's part 0 with B's parts 1.. into a row
    neither copy holds; the row handed out must be B's."""
    group, parts = split_group()
    copy_a = [(ROWS.decode(b), b) for b in parts[1]]
    copy_b = other_copy(parts[1])
    others = [(ROWS.decode(b), b) for i in (0, 2) for b in parts[i]]
    log = others + copy_a[:1] + copy_b
    assembler = GroupAssembler()
    if with_position:
        done = feed(assembler, log)
    else:
        done = [g for record, raw in log if (g := assembler.add_row(record, raw)) is not None]
    assert len(done) == 1
    want = bytes(b ^ 0x01 for b in group.rows[1].input_ids.numpy().tobytes())
    assert done[0].records[1]["input_ids"]["data"] == want
    assert done[0].rows[1].input_ids.numpy().tobytes() == want
    assert assembler.counts["stale_parts"] == 1 and assembler.counts["conflicts"] == 0


def test_a_stale_part_of_another_copy_first_does_not_block_the_committed_copy():
    """Issue 29 item 8: parts 1.. of a copy whose part 0 lies before the reader's start arrive
    first; they made the committed copy's parts 'conflicts', the row never completed and the
    group was abandoned. They are stale: dropped, counted, and the committed copy is used."""
    group, parts = split_group()
    stale = other_copy(parts[1])[1:]
    log = stale + [(ROWS.decode(b), b) for row in parts for b in row]
    assembler = GroupAssembler()
    done = feed(assembler, log)
    assert len(done) == 1 and assembler.counts["conflicts"] == 0
    assert assembler.counts["stale_parts"] == len(stale)
    assert torch.equal(done[0].rows[1].input_ids, group.rows[1].input_ids)


def test_a_later_copy_with_other_content_is_a_conflict_and_the_first_copy_wins():
    group, parts = split_group()
    log = [(ROWS.decode(b), b) for row in parts for b in row] + other_copy(parts[1])
    assembler = GroupAssembler()
    done = feed(assembler, log)
    assert len(done) == 1 and assembler.counts["conflicts"] == len(parts[1])
    assert torch.equal(done[0].rows[1].input_ids, group.rows[1].input_ids)


def test_a_copy_whose_parts_disagree_makes_no_row_and_a_later_copy_does():
    group, parts = split_group()
    bad = [(ROWS.decode(parts[1][0]), parts[1][0])]
    bad += [(dict(ROWS.decode(b), truncated=True), b) for b in parts[1][1:]]
    assembler = GroupAssembler()
    assert feed(assembler, bad) == []
    assert assembler.counts["invalid"] == 1 and 1 not in assembler.pending["grp"].rows
    done = feed(assembler, [(ROWS.decode(b), b) for row in parts for b in row])
    assert len(done) == 1 and torch.equal(done[0].rows[1].input_ids, group.rows[1].input_ids)


@pytest.mark.parametrize("part", [{"index": 0, "count": 1}, {"index": 2, "count": 2},
                                  {"index": 0, "count": 5000}])
def test_impossible_part_numbers_are_invalid(part):
    _, parts = split_group()
    assembler = GroupAssembler()
    assert assembler.add_row(dict(ROWS.decode(parts[1][0]), row_part=part)) is None
    assert assembler.counts["invalid"] == 1
