"""Rows the stage published in ``row_part`` records (a row over its max_record_bytes): the copies
of a row being gathered, and ``merge_row_parts`` that makes the whole record (docs/schemas.md).

A *copy* of a split row is the run of parts 0..count-1 one publication wrote back to back into
one partition: the stage produces a row's parts one after another in one transaction. A second
publication of the group, or a broker that shows aborted records to read_committed readers, adds
another run, possibly with other tensor bytes under the same plain fields. Parts are only ever
joined with parts of their own run, since mixing two copies could hand out a row neither holds:
in partition order, part i joins the copy of that partition which holds exactly parts 0..i-1; a
part 0 starts a new copy (an unfinished one is dropped: its run was cut); any other part is
*stale* (its copy began before this reader's start position, or its run was cut) and is dropped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stage.publish.records import ROW_TENSOR_FIELDS

# ``RowCopies.add`` outcomes besides a whole row
HELD = "held"          # the part joined its copy, which is not whole yet
STALE = "stale"        # the part belongs to no copy being gathered: dropped
INVALID = "invalid"    # the copy's parts do not make one row: the copy is dropped


def merge_row_parts(parts: list[Mapping[str, Any]]) -> dict:
    """The whole CanonicalRow record from its ``row_part`` records (in part index order): every
    tensor field's parts concatenated along dimension 0 (their data bytes, C order), every other
    field as the parts all carry it. ValueError when the parts do not make one row."""
    first = parts[0]
    scalars = [k for k in first if k not in ROW_TENSOR_FIELDS and k != "row_part"]
    for part in parts[1:]:
        differ = [k for k in scalars if part.get(k) != first[k]]
        if differ:
            raise ValueError(f"row parts of {first['sample_id']} disagree on {differ}")
    merged = {k: first[k] for k in scalars}
    merged["row_part"] = None
    for name in ROW_TENSOR_FIELDS:
        values = [part.get(name) for part in parts]
        if all(v is None for v in values):
            merged[name] = None
            continue
        if any(v is None for v in values):
            raise ValueError(f"row parts of {first['sample_id']}: {name} is null in some parts only")
        head = values[0]
        if any(len(v["shape"]) < 1 or v["dtype"] != head["dtype"] or v["shape"][1:] != head["shape"][1:]
               for v in values):
            raise ValueError(f"row parts of {first['sample_id']}: {name} differs in dtype or trailing "
                             "dims between parts")
        merged[name] = {"dtype": head["dtype"], "shape": [sum(v["shape"][0] for v in values),
                                                           *head["shape"][1:]],
                        "data": b"".join(v["data"] for v in values)}
    if merged["input_ids"]["shape"][0] != merged["input_lengths"]:
        raise ValueError(f"row parts of {first['sample_id']} hold {merged['input_ids']['shape'][0]} "
                         f"tokens, input_lengths is {merged['input_lengths']}")
    return merged


@dataclass(eq=False)
class _Copy:
    count: int
    records: list = field(default_factory=list)    # parts 0..len-1, in order
    digests: list = field(default_factory=list)


@dataclass(frozen=True)
class WholeRow:
    record: dict                 # the merged CanonicalRow record
    digest: bytes                # over the copy's part digests, in order
    part_digests: tuple          # one per part: later copies of the row are compared with these


class RowCopies:
    """The unfinished copies of one group's split rows, at most one per (row, partition).
    ``dropped`` counts the part records dropped as stale or with a cut copy."""

    def __init__(self) -> None:
        self.open: dict[tuple[int, Any], _Copy] = {}
        self.dropped = 0
        self.last_error: Exception | None = None     # why the last INVALID copy made no row

    def add(self, index: int, stream, record: Mapping[str, Any], digest: bytes) -> WholeRow | str:
        """One part (its number and count already checked) of row ``index`` read from ``stream``
        (the (topic, partition) it came from; None when unknown: one stream). The whole row when
        this part finishes its copy; else HELD, STALE or INVALID (``last_error`` says why)."""
        number, count = record["row_part"]["index"], record["row_part"]["count"]
        key = (index, stream)
        if number == 0:
            cut = self.open.pop(key, None)
            if cut is not None:
                self.dropped += len(cut.records)
            self.open[key] = copy = _Copy(count)
        else:
            copy = self.open.get(key)
            if copy is None or copy.count != count or len(copy.records) != number:
                self.dropped += 1
                return STALE
        copy.records.append(record)
        copy.digests.append(digest)
        if len(copy.records) < count:
            return HELD
        del self.open[key]
        try:
            whole = merge_row_parts(copy.records)
        except (ValueError, KeyError, TypeError) as error:
            self.last_error = error
            return INVALID
        combined = hashlib.blake2b(b"".join(copy.digests), digest_size=16).digest()
        return WholeRow(whole, combined, tuple(copy.digests))

    def drop_row(self, index: int) -> None:
        """Row ``index`` is whole (another copy finished first): its unfinished copies go."""
        for key in [k for k in self.open if k[0] == index]:
            self.dropped += len(self.open.pop(key).records)
