"""RoutePlan records written directly as Avro binary: the same bytes as ``AvroCodec.encode``.

In deferred router replay every row publishes a RoutePlan naming each of its calls: ~60 spans a
row at agentic sizes, and with routes staged by reference each span carries the call's route
reference and its boundary route. Through the general codec (fastavro's validation, then its
writer) that was ~2 ms a row, the largest cost routes by reference add to a deferred group
(docs/performance.md, End to end with routes by reference). This writer emits the schema's
binary encoding field by field from the ``plan_record`` dict (stage.publish.records). Anything
it does not expect (a type, an int out of range, a dtype name, a non-plain framing, a tensor
whose data is not bytes) makes it hand the record to the codec instead, so an invalid record
fails with the codec's own WireError, and the output is the codec's bytes either way
(tests/publish/test_plan_writer.py compares them).
"""

from __future__ import annotations

import json
from pathlib import Path

from stage.wire import AvroCodec, WireError, zigzag_long

_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
# Non-negative ints below 8192 (flags, indexes, layer and top-k counts, most token lengths) as
# their one- or two-byte varint, looked up instead of encoded: ~20 longs a span.
_SMALL_LIMIT = 1 << 13


_SMALL = [zigzag_long(n) for n in range(_SMALL_LIMIT)]


def _dtype_symbols() -> dict[str, bytes]:
    schema = json.loads((Path(__file__).parent.parent / "wire" / "avsc" / "PackedTensor.avsc").read_text())
    dtype = next(f["type"] for f in schema["fields"] if f["name"] == "dtype")
    return {name: bytes([i << 1]) for i, name in enumerate(dtype["symbols"])}


_DTYPE = _dtype_symbols()


class _Unexpected(Exception):
    """The record holds something this writer does not encode: the codec takes it."""


def _long(n, lo: int = _LONG_MIN, hi: int = _LONG_MAX) -> bytes:
    if type(n) is not int:
        raise _Unexpected
    if 0 <= n < _SMALL_LIMIT:
        return _SMALL[n]
    if not lo <= n <= hi:
        raise _Unexpected
    return zigzag_long(n)


def _int(n) -> bytes:
    return _long(n, _INT_MIN, _INT_MAX)


def _str(s) -> bytes:
    if type(s) is not str:
        raise _Unexpected
    b = s.encode("utf-8")
    return _long(len(b)) + b


def _bytes(b) -> bytes:
    if type(b) is not bytes:
        raise _Unexpected
    return _long(len(b)) + b


def _longs(values) -> bytes:
    if type(values) is not list:
        raise _Unexpected
    if not values:
        return b"\x00"
    return b"".join((_long(len(values)), *map(_long, values), b"\x00"))


def _tensor(t) -> bytes:
    if type(t) is not dict or len(t) != 3:
        raise _Unexpected
    symbol = _DTYPE.get(t["dtype"])
    if symbol is None:
        raise _Unexpected
    return b"".join((symbol, _longs(t["shape"]), _bytes(t["data"])))


def _reference(r) -> bytes:
    if type(r) is not dict or len(r) != 5:
        raise _Unexpected
    symbol = _DTYPE.get(r["dtype"])
    chunks = r["chunks"]
    if symbol is None or type(chunks) is not list:
        raise _Unexpected
    parts = [_str(r["topic"]), _int(r["partition"]), symbol, _longs(r["shape"])]
    if chunks:
        parts.append(_long(len(chunks)))
        for c in chunks:
            if type(c) is not dict or len(c) != 3:
                raise _Unexpected
            parts += (_long(c["offset"]), _long(c["length"]), _str(c["sha256"]))
    parts.append(b"\x00")
    return b"".join(parts)


def _chunks(c) -> bytes:
    if c is None:
        return b"\x00"
    if type(c) is not dict or len(c) != 4:
        raise _Unexpected
    boundary = c["boundary"]
    return b"".join((b"\x02", _reference(c["reference"]), _int(c["route_encoding"]),
                     _str(c["extras_metadata_json"]),
                     b"\x00" if boundary is None else b"\x02" + _tensor(boundary)))


def _fragment(f) -> bytes:
    if f is None:
        return b"\x00"
    if type(f) is not dict or len(f) != 3:
        raise _Unexpected
    return b"".join((b"\x02", _str(f["topic"]), _int(f["partition"]), _long(f["offset"])))


def _span(s) -> bytes:
    if type(s) is not dict or len(s) != 10:
        raise _Unexpected
    index, repair = s["boundary_token_index"], s["repair_previous_token"]
    if type(repair) is not bool:
        raise _Unexpected
    return b"".join((
        _str(s["staging_key"]), _long(s["carry_len"]), _long(s["generation_len"]),
        _long(s["staged_route_len"]), _int(s["extras_digest_version"]), _str(s["extras_digest"]),
        b"\x00" if index is None else b"\x02" + _long(index), b"\x01" if repair else b"\x00",
        _fragment(s["fragment"]), _chunks(s["chunks"])))


def _plan(record) -> bytes:
    if type(record) is not dict or len(record) != 8:
        raise _Unexpected
    spans, keys = record["spans"], record["cleanup_staging_keys"]
    if type(spans) is not list or type(keys) is not list:
        raise _Unexpected
    parts = [_str(record["group_id"]), _str(record["sample_id"]), _int(record["row_index"]),
             _int(record["schema_version"]), _str(record["staging_partition"])]
    if spans:
        parts.append(_long(len(spans)))
        parts += map(_span, spans)
    parts.append(b"\x00")
    if keys:
        parts.append(_long(len(keys)))
        parts += map(_str, keys)
    parts.append(b"\x00")
    parts.append(_long(record["expected_token_length"]))
    return b"".join(parts)


def encode_plan(codec: AvroCodec, record: dict) -> bytes:
    """``codec.encode(record)`` for a RoutePlan record as ``plan_record`` builds it: written
    here when it holds what the schema allows and the codec frames plainly, by the codec
    otherwise. WireError as the codec raises it (invalid record, over ``max_record_bytes``)."""
    if codec.schema_name != "RoutePlan" or codec.framing != "plain":
        return codec.encode(record)
    try:
        data = _plan(record)
    except (_Unexpected, KeyError, TypeError, UnicodeEncodeError):
        return codec.encode(record)
    if len(data) > codec.max_record_bytes:
        return codec.encode(record)     # raises the codec's WireError over the cap
    return data


__all__ = ["WireError", "encode_plan"]
