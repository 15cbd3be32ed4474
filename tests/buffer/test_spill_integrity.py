"""Spilled records come back as they were written or not at all (issue 29 item 6), and spill
segments are never written or read through links (item 11)."""

from __future__ import annotations

import os

import pytest

from stage.buffer.spill import SpillReadError, SpillStore


def _flip(path: str, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


@pytest.mark.parametrize("where", [0, 37, 99])
def test_a_flipped_bit_is_a_read_error_not_other_bytes(tmp_path, where):
    store = SpillStore(tmp_path / "p0", max_bytes=1 << 20)
    first, second = store.put(bytes(range(100))), store.put(b"b" * 50)
    _flip(first.path, first.offset + where, bit=where % 8)
    with pytest.raises(SpillReadError, match="checksum mismatch"):
        first.read()
    assert second.read() == b"b" * 50            # its neighbour is untouched


def test_a_segment_replaced_by_a_link_is_a_read_error(tmp_path):
    store = SpillStore(tmp_path / "p0", max_bytes=1 << 20)
    ref = store.put(b"x" * 64)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"x" * 64)
    os.unlink(ref.path)
    os.symlink(elsewhere, ref.path)
    with pytest.raises(SpillReadError):
        ref.read()


def test_a_link_planted_where_a_segment_goes_is_never_written_through(tmp_path):
    directory = tmp_path / "p0"
    directory.mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    os.symlink(target, directory / "segment-000001")
    store = SpillStore(directory, max_bytes=1 << 20)
    assert store.put(b"spilled bytes") is None and store.failed   # stays in memory instead
    assert target.read_bytes() == b"precious"


def test_a_partition_directory_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "p0")
    store = SpillStore(tmp_path / "p0", max_bytes=1 << 20)
    assert store.put(b"spilled bytes") is None and "symbolic link" in store.failed
    assert list(elsewhere.iterdir()) == []
