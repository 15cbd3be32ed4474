"""Routes by reference: the reference's checks, chunking and joining, and the wire records."""

import numpy as np
import pytest

from stage.staging.route_refs import (
    MAX_ROUTE_CHUNKS,
    RouteReference,
    RouteReferenceError,
    check_chunk,
    chunk_sha256,
    chunk_value,
    join_chunks,
    split_payload,
)
from stage.wire import AvroCodec


def _reference(routes: np.ndarray, chunk_bytes: int, first_offset: int = 10):
    pieces = split_payload(routes.tobytes(), chunk_bytes)
    chunks = [chunk_value("g", "r0/c0", i, len(pieces), p) for i, p in enumerate(pieces)]
    value = {"topic": "rollouts.staged-routes", "partition": 3, "dtype": "int16",
             "shape": list(routes.shape),
             "chunks": [{"offset": first_offset + 2 * i, "length": len(c["data"]), "sha256": c["sha256"]}
                        for i, c in enumerate(chunks)]}
    return value, chunks


def test_a_payload_split_checked_and_joined_is_the_payload():
    routes = np.arange(37 * 4 * 2, dtype="<i2").reshape(37, 4, 2)
    value, chunks = _reference(routes, 100)
    ref = RouteReference.from_value(value, max_chunk_bytes=100, delta_len=37)
    assert len(ref.chunks) == 6 and ref.payload_bytes == routes.nbytes
    datas = [check_chunk(ref, i, c, group_id="g", staging_key="r0/c0") for i, c in enumerate(chunks)]
    joined = join_chunks(ref, datas)
    assert np.array_equal(np.frombuffer(joined, "<i2").reshape(37, 4, 2), routes)
    assert ref.to_value() == value


@pytest.mark.parametrize("change, reason", [
    (lambda v: v.update(dtype="int64"), "dtype must be one of"),
    (lambda v: v.update(shape=[37, 4]), "three positive dims"),
    (lambda v: v.update(shape=[36, 4, 2]), "not delta-aligned"),
    (lambda v: v.update(partition=-1), "partition must be >= 0"),
    (lambda v: v.update(chunks=[]), "names no chunks"),
    (lambda v: v["chunks"][1].update(offset=v["chunks"][0]["offset"]), "is not after"),
    (lambda v: v["chunks"][1].update(length=v["chunks"][1]["length"] + 2), "outside 1..100"),
    (lambda v: v["chunks"][2].update(length=v["chunks"][2]["length"] - 2), "sum to"),
    (lambda v: v["chunks"][0].update(sha256="AB" * 32), "not a lowercase SHA-256"),
    (lambda v: v.update(chunks=v["chunks"] * (MAX_ROUTE_CHUNKS // 3 + 1)), "more than"),
])
def test_a_bad_reference_is_refused_with_its_reason(change, reason):
    value, _ = _reference(np.zeros((37, 4, 2), dtype="<i2"), 100)
    change(value)
    with pytest.raises(RouteReferenceError, match=reason):
        RouteReference.from_value(value, max_chunk_bytes=100, delta_len=37)


@pytest.mark.parametrize("change, reason", [
    (lambda c: c.update(staging_key="r0/c1"), "belongs to"),
    (lambda c: c.update(index=2), "says it is chunk 2"),
    (lambda c: c.update(data=c["data"][:-1]), "holds 99 bytes"),
    (lambda c: c.update(data=bytes([c["data"][0] ^ 1]) + c["data"][1:]), "corrupt"),
    (lambda c: c.update(sha256=chunk_sha256(b"x")), "another sha256"),
])
def test_a_chunk_that_is_not_the_named_one_is_refused(change, reason):
    value, chunks = _reference(np.arange(37 * 8, dtype="<i2").reshape(37, 4, 2), 100)
    ref = RouteReference.from_value(value, max_chunk_bytes=100)
    chunk = dict(chunks[1])
    change(chunk)
    with pytest.raises(RouteReferenceError, match=reason):
        check_chunk(ref, 1, chunk, group_id="g", staging_key="r0/c0")


def test_route_chunks_and_references_round_trip_through_avro():
    routes = np.arange(5 * 3 * 2, dtype="<i2").reshape(5, 3, 2)
    value, chunks = _reference(routes, 16)
    codec = AvroCodec("RouteChunk")
    assert [codec.decode(codec.encode(c)) for c in chunks] == chunks
    from stage.wire import schema
    fields = {f["name"] for f in schema("StagedCall")["fields"]}
    assert "routes_ref" in fields
    span = next(f for f in schema("RoutePlan")["fields"] if f["name"] == "spans")
    assert "chunks" in {f["name"] for f in span["type"]["items"]["fields"]}
