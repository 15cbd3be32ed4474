"""Spilling staged records to local disk while the stage holds its memory cap: the store keeps
what it is given and deletes a segment once nothing in it is buffered; the buffer moves an
admitted staged call's bytes there and gives them back when its group leaves."""

import os

import pytest

from stage.buffer import ADDED, PartitionBuffer, Position, StagedItem
from stage.buffer.spill import SpilledRecord, SpillReadError, SpillStore

S = "staged"


def test_records_come_back_whole_and_segments_go_when_nothing_in_them_is_live(tmp_path):
    store = SpillStore(tmp_path / "p0", max_bytes=10_000, segment_bytes=100)
    first = store.put(b"a" * 60)
    second = store.put(b"b" * 60)          # first segment is full now: a new one for the next
    third = store.put(b"c" * 10)
    assert (first.read(), second.read(), third.read()) == (b"a" * 60, b"b" * 60, b"c" * 10)
    assert first.path == second.path != third.path and store.live_bytes == 130
    store.release(first)
    assert os.path.exists(first.path)      # the second record still lives in that segment
    store.release(second)
    assert not os.path.exists(first.path) and store.segments == 1
    assert store.put(b"x" * 9_991) is None  # over max_bytes: the caller keeps it in memory
    store.close()
    assert not (tmp_path / "p0").exists()
    with pytest.raises(SpillReadError):
        third.read()                       # the disk's fault, never the record's


def test_a_spilled_staged_call_frees_its_memory_and_comes_back_when_its_group_leaves(tmp_path):
    store = SpillStore(tmp_path / "p0", max_bytes=1 << 20)
    buffer = PartitionBuffer(0, receipts_topic="r", staged_topic=S, group_timeout_ms=1000,
                             late_retention_ms=1000, spill=store)
    item = StagedItem(group_id="g", staging_key="r0/c0", payload={"decoded": True},
                      position=Position(S, 0, 0, 0), nbytes=5_000)
    assert buffer.add_staged(item, 0) == ADDED and buffer.nbytes == 5_000
    assert buffer.spill_staged(item, b"wire bytes" * 100, keep=200)
    assert isinstance(item.payload, SpilledRecord) and item.payload.read() == b"wire bytes" * 100
    assert (item.nbytes, buffer.nbytes, buffer.spilled_bytes) == (200, 200, 1_000)
    assert buffer.groups["g"].spilled_bytes == 1_000 and store.live_bytes == 1_000
    assert not buffer.spill_staged(item, b"again", keep=200)    # once only
    buffer.take_ready(10_000, None)                              # the deadline: the orphan expires
    assert buffer.spilled_bytes == 0 and store.live_bytes == 0 and store.segments == 0


def test_a_disk_that_refuses_leaves_the_records_in_memory(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the spill directory should go")
    store = SpillStore(blocker / "p0", max_bytes=1 << 20)
    assert store.put(b"x" * 100) is None and "Error" in store.failed
    assert store.put(b"y" * 100) is None and store.live_bytes == 0   # it does not try again
