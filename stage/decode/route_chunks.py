"""Direct router replay: RouteChunk records -> buffer items at intake, and a by-reference staged
row's chunks -> its route tensor at finalization.

Intake (poll thread) checks what the buffer needs, bounded before anything is kept: the ids, the
chunk's index and count, its declared SHA-256 and its data's size. The bytes are hashed only at
finalization (``join_route_chunks``, off the poll thread), where a chunk that does not match its
reference rejects the rollout with the reason, as a staged row that fails its checks does.

A staged call names its chunks by their offsets in (route topic, partition) in ``routes_ref``;
the buffer keys a group's chunks by (staging_key, offset), so of two records of the same chunk
(a producer retry) the one the reference names is read, and the other is dropped with its group.

The staged call's ``routes_ref`` is decoded and checked by ``stage.decode.staged.route_reference``
(at intake: which chunks a group waits for; at finalization: the row's ``route_ref``).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from stage.buffer import Position
from stage.buffer.items import RouteChunkItem
from stage.decode.errors import DecodeError
from stage.decode.limits import InputLimits
from stage.decode.receipts import _identifier
from stage.staging.route_refs import (
    MAX_ROUTE_CHUNKS,
    RouteReferenceError,
    check_chunk,
    join_chunks,
)

# Python objects of a decoded RouteChunk beyond its data (the dict, ids, digest, the item):
# what a spilled chunk still holds in memory.
CHUNK_OVERHEAD_BYTES = 1_200
SPILLED_CHUNK_BYTES = CHUNK_OVERHEAD_BYTES
_HEX = re.compile(r"[0-9a-f]{64}")


def route_chunk_item(record: dict, position: Position, nbytes: int,
                     limits: InputLimits = InputLimits()) -> RouteChunkItem:
    """A decoded RouteChunk checked for the buffer (DecodeError: dead-lettered with its reason).
    ``nbytes`` is the record's size on the wire; the item holds that plus its objects."""
    group_id = _identifier(record.get("group_id"), "group_id", limits)
    key = _identifier(record.get("staging_key"), "staging_key", limits)
    count, index = record.get("count"), record.get("index")
    if type(count) is not int or not 0 < count <= MAX_ROUTE_CHUNKS:
        raise DecodeError(f"must be in 1..{MAX_ROUTE_CHUNKS}, got {count!r}", field="count")
    if type(index) is not int or not 0 <= index < count:
        raise DecodeError(f"must be in 0..{count - 1} (count {count}), got {index!r}", field="index")
    digest = record.get("sha256")
    if not isinstance(digest, str) or not _HEX.fullmatch(digest):
        raise DecodeError("must be a lowercase hex SHA-256 digest", field="sha256")
    data = record.get("data")
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise DecodeError("a route chunk holds at least one byte", field="data")
    return RouteChunkItem(group_id=group_id, staging_key=key, index=index, count=count,
                          payload=record, position=position, nbytes=nbytes + CHUNK_OVERHEAD_BYTES)


def join_route_chunks(row, chunks: dict, *, group_id: str, topic: str, partition: int, load=None):
    """``row`` with ``routes`` joined from the buffered ``chunks`` ((staging_key, offset) ->
    RouteChunkItem) its reference names, each checked (identity, position, length, SHA-256).
    KeyError for a chunk that was never read (missing_staging_row); RouteReferenceError for one
    that is not what the reference says (invalid_staging_row). ``load``: (SpilledRecord) ->
    the decoded RouteChunk of a chunk the buffer spilled."""
    ref = row.route_ref
    if ref is None or row.routes is not None:
        return row
    key = row.staging_key
    if ref.topic != topic or ref.partition != partition:
        raise RouteReferenceError(f"route reference of {key} names {ref.topic}[{ref.partition}]; this "
                                  f"stage reads the route chunks of this group at {topic}[{partition}]")
    datas = []
    for index, chunk_ref in enumerate(ref.chunks):
        item = chunks.get((key, chunk_ref.offset))
        if item is None:
            raise KeyError(f"route chunk {index} of {key} at {topic}[{partition}]@{chunk_ref.offset} was "
                           "not read with its group (lost, expired, or keyed to another group)")
        chunk = load(item.payload) if item.spilled and load is not None else item.payload
        datas.append(check_chunk(ref, index, chunk, group_id=group_id, staging_key=key, verify_digest=True))
    # One chunk (a call's routes under the chunk size: most calls) is used where it lies, a view
    # of its record's bytes; several are joined into one allocation.
    joined = datas[0] if len(datas) == 1 else join_chunks(ref, datas)
    # little-endian on the wire; native (no copy on a little-endian host) for the executor
    routes = np.frombuffer(joined, dtype=np.dtype(ref.dtype).newbyteorder("<")).reshape(ref.shape)
    routes = routes.astype(np.dtype(ref.dtype), copy=False)
    return dataclasses.replace(row, routes=routes)
