"""Routes staged by reference: a call's routed-experts payload travels as ``RouteChunk``
records on the route topic, and the staged call carries a ``RouteReference`` naming them.

Pure functions over the wire values (no Kafka here). The producer splits the payload
(``split_payload``) and builds the reference from where each chunk landed; whoever reads the
bytes (the trainer's fetcher in deferred mode, the stage in direct mode) checks the reference
first (``RouteReference.from_value``: shape, dtype, lengths, digests, bounded before anything
is allocated) and the chunks against it (``check_chunk``), then joins them (``join_chunks``).
The Gym extras digest over the routes is unchanged: a chunk's SHA-256 only says which chunk is
wrong; the extras digest is what binds the bytes to the receipt.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Route dtypes a reference may name, with their item sizes (the staged route dtypes).
ROUTE_ITEMSIZE = {"int8": 1, "int16": 2, "int32": 4}
# A chunk's default payload: records of ~4 MiB fit every managed Kafka's default cap (8 MB)
# with room for the rest of the record, and a 32k-token 48x8 int16 call is 6 chunks.
DEFAULT_ROUTE_CHUNK_BYTES = 4 << 20
# Bounds a reference is checked against before anything is allocated for it.
MAX_ROUTE_CHUNKS = 4096
MAX_ROUTE_PAYLOAD_BYTES = 1 << 34       # 16 GiB: far above any call (frontier 128k: 225 MB)

_HEX = re.compile(r"[0-9a-f]{64}")


class RouteReferenceError(ValueError):
    """A reference or chunk that cannot be what it claims; the text says exactly why."""


@dataclass(frozen=True)
class ChunkRef:
    offset: int     # the RouteChunk record's offset in (topic, partition)
    length: int     # payload bytes it holds
    sha256: str     # lowercase hex SHA-256 of its data


@dataclass(frozen=True)
class RouteReference:
    topic: str
    partition: int
    dtype: str                       # int8 | int16 | int32
    shape: tuple[int, int, int]      # delta_len, L, K
    chunks: tuple[ChunkRef, ...]

    @property
    def payload_bytes(self) -> int:
        t, l, k = self.shape
        return t * l * k * ROUTE_ITEMSIZE[self.dtype]

    @property
    def start(self) -> tuple[int, ...]:
        """Each chunk's first byte in the payload."""
        out, at = [], 0
        for c in self.chunks:
            out.append(at)
            at += c.length
        return tuple(out)

    def to_value(self) -> dict:
        """The Avro ``RouteReference`` value."""
        return {"topic": self.topic, "partition": self.partition, "dtype": self.dtype,
                "shape": list(self.shape),
                "chunks": [{"offset": c.offset, "length": c.length, "sha256": c.sha256}
                           for c in self.chunks]}

    @classmethod
    def from_value(cls, value: Mapping[str, Any], *, max_chunk_bytes: int,
                   delta_len: int | None = None) -> "RouteReference":
        """Check a decoded ``RouteReference`` value completely; RouteReferenceError otherwise.
        ``max_chunk_bytes``: the largest chunk payload the reader accepts (its record cap);
        ``delta_len``: the staged call's, which the shape's first dimension must equal."""
        try:
            topic, partition, dtype = value["topic"], value["partition"], value["dtype"]
            shape, chunks = value["shape"], value["chunks"]
        except (KeyError, TypeError):
            raise RouteReferenceError("route reference lacks topic, partition, dtype, shape or chunks") from None
        if not isinstance(topic, str) or not topic:
            raise RouteReferenceError("route reference names no topic")
        if type(partition) is not int or partition < 0:
            raise RouteReferenceError(f"route reference partition must be >= 0, got {partition!r}")
        if dtype not in ROUTE_ITEMSIZE:
            raise RouteReferenceError(f"route reference dtype must be one of {sorted(ROUTE_ITEMSIZE)}, got {dtype!r}")
        if not isinstance(shape, (list, tuple)) or len(shape) != 3 \
                or any(type(d) is not int or d <= 0 for d in shape):
            raise RouteReferenceError(f"route reference shape must be three positive dims [delta_len, L, K], got {shape!r}")
        if delta_len is not None and shape[0] != delta_len:
            raise RouteReferenceError(f"route reference shape {list(shape)} is not delta-aligned (delta_len={delta_len})")
        payload = shape[0] * shape[1] * shape[2] * ROUTE_ITEMSIZE[dtype]
        if payload > MAX_ROUTE_PAYLOAD_BYTES:
            raise RouteReferenceError(f"route reference payload {payload} bytes exceeds {MAX_ROUTE_PAYLOAD_BYTES}")
        if not isinstance(chunks, (list, tuple)) or not chunks:
            raise RouteReferenceError("route reference names no chunks")
        if len(chunks) > MAX_ROUTE_CHUNKS:
            raise RouteReferenceError(f"route reference names {len(chunks)} chunks, more than {MAX_ROUTE_CHUNKS}")
        refs, total, last = [], 0, -1
        for i, c in enumerate(chunks):
            try:
                offset, length, digest = c["offset"], c["length"], c["sha256"]
            except (KeyError, TypeError):
                raise RouteReferenceError(f"route chunk reference {i} lacks offset, length or sha256") from None
            if type(offset) is not int or offset <= last:
                raise RouteReferenceError(f"route chunk {i} offset {offset!r} is not after the previous chunk's ({last})")
            if type(length) is not int or not 0 < length <= max_chunk_bytes:
                raise RouteReferenceError(f"route chunk {i} length {length!r} is outside 1..{max_chunk_bytes} (max_record_bytes)")
            if not isinstance(digest, str) or not _HEX.fullmatch(digest):
                raise RouteReferenceError(f"route chunk {i} sha256 is not a lowercase SHA-256 hex digest")
            refs.append(ChunkRef(offset, length, digest))
            total += length
            last = offset
        if total != payload:
            raise RouteReferenceError(f"route chunk lengths sum to {total} bytes, the shape {list(shape)} "
                                      f"of {dtype} needs {payload}")
        return cls(topic, partition, dtype, (shape[0], shape[1], shape[2]), tuple(refs))


def chunk_sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def split_payload(raw, chunk_bytes: int = DEFAULT_ROUTE_CHUNK_BYTES) -> list[memoryview]:
    """The payload in pieces of at most ``chunk_bytes`` (views, no copy), in order."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    view = memoryview(raw).cast("B")
    if not len(view):
        raise ValueError("a route payload has at least one byte")
    return [view[at:at + chunk_bytes] for at in range(0, len(view), chunk_bytes)]


def chunk_value(group_id: str, staging_key: str, index: int, count: int, data) -> dict:
    """The Avro ``RouteChunk`` value of one piece (``data``: bytes-like)."""
    data = bytes(data)
    return {"group_id": group_id, "staging_key": staging_key, "index": index, "count": count,
            "sha256": chunk_sha256(data), "data": data}


def check_chunk(reference: RouteReference, index: int, chunk: Mapping[str, Any], *,
                group_id: str, staging_key: str, verify_digest: bool = True) -> memoryview:
    """The data of ``chunk`` (a decoded RouteChunk) if it is the reference's ``index``-th
    chunk of this call: identity, position, length and (``verify_digest``) SHA-256.
    RouteReferenceError naming the first difference otherwise."""
    ref = reference.chunks[index]
    where = f"route chunk {index} of {staging_key} at offset {ref.offset}"
    if chunk.get("group_id") != group_id or chunk.get("staging_key") != staging_key:
        raise RouteReferenceError(f"{where} belongs to {chunk.get('group_id')!r}/{chunk.get('staging_key')!r}")
    if chunk.get("index") != index or chunk.get("count") != len(reference.chunks):
        raise RouteReferenceError(f"{where} says it is chunk {chunk.get('index')!r} of {chunk.get('count')!r}, "
                                  f"the reference names {index} of {len(reference.chunks)}")
    data = memoryview(chunk.get("data", b"")).cast("B")
    if len(data) != ref.length:
        raise RouteReferenceError(f"{where} holds {len(data)} bytes, the reference names {ref.length}")
    if chunk.get("sha256") != ref.sha256:
        raise RouteReferenceError(f"{where} declares another sha256 than its reference")
    if verify_digest and chunk_sha256(data) != ref.sha256:
        raise RouteReferenceError(f"{where} does not match its sha256 (corrupt)")
    return data


def join_chunks(reference: RouteReference, datas: Sequence) -> bytearray:
    """The payload from its chunks' data, in order (lengths checked, one allocation)."""
    if len(datas) != len(reference.chunks):
        raise RouteReferenceError(f"{len(datas)} chunks given, the reference names {len(reference.chunks)}")
    out = bytearray(reference.payload_bytes)
    view, at = memoryview(out), 0
    for ref, data in zip(reference.chunks, datas):
        data = memoryview(data).cast("B")
        if len(data) != ref.length:
            raise RouteReferenceError(f"chunk at offset {ref.offset} holds {len(data)} bytes, "
                                      f"the reference names {ref.length}")
        view[at:at + ref.length] = data
        at += ref.length
    return out
