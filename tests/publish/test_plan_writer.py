"""The RoutePlan writer (stage.publish.plan_writer) emits exactly the codec's bytes, and hands
every record it does not expect to the codec, so errors are the codec's."""

import hashlib

import numpy as np
import pytest

from stage.publish import plan_writer
from stage.publish.plan_writer import encode_plan
from stage.wire import AvroCodec, WireError, pack_tensor


def _sha(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _chunks(i: int, n_chunks: int, dtype: str = "int16", boundary: bool = True) -> dict:
    rng = np.random.default_rng(i)
    return {
        "reference": {"topic": "rollouts.staged-routes", "partition": 3 + i, "dtype": dtype,
                      "shape": [40 + i, 48, 8],
                      "chunks": [{"offset": (1 << 40) + 7 * i + k, "length": 1000 + k, "sha256": _sha(k)}
                                 for k in range(n_chunks)]},
        "route_encoding": 1, "extras_metadata_json": f'{{"routed_experts_boundary_index":{i}}}',
        "boundary": pack_tensor(rng.integers(-1, 128, (1, 48, 8)).astype(dtype)) if boundary else None}


def _span(i: int, **over) -> dict:
    span = {"staging_key": f"r{i}/c{i}", "carry_len": 3 * i, "generation_len": 70 + i,
            "staged_route_len": 73 + 4 * i, "extras_digest_version": 1, "extras_digest": _sha(i),
            "boundary_token_index": None if i == 0 else 200 * i - 1, "repair_previous_token": i % 2 == 1,
            "fragment": None, "chunks": None}
    span.update(over)
    return span


def _plan(spans, keys=None, **over) -> dict:
    record = {"group_id": "g-7", "sample_id": "g-7_g3", "row_index": 3, "schema_version": 3,
              "staging_partition": "rollouts.staged-calls", "spans": spans,
              "cleanup_staging_keys": [s["staging_key"] for s in spans] if keys is None else keys,
              "expected_token_length": sum(s["carry_len"] + s["generation_len"] for s in spans)}
    record.update(over)
    return record


PLANS = {
    "by reference, one and several chunks, with and without a boundary": _plan(
        [_span(0, chunks=_chunks(0, 1, boundary=False)), _span(1, chunks=_chunks(1, 3)),
         _span(2, chunks=_chunks(2, 1, dtype="int8")), _span(3, chunks=_chunks(3, 70, dtype="int32"))]),
    "inline fragments and a span without routes": _plan(
        [_span(0, fragment={"topic": "rollouts.staged-calls", "partition": 1, "offset": 5}),
         _span(1, staged_route_len=0),
         _span(2, fragment={"topic": "rollouts.staged-calls", "partition": 0, "offset": (1 << 62) + 9})]),
    "placeholder (no spans) with off-chain keys": _plan([], keys=["a/b", "a/c"], expected_token_length=1),
    "no spans, no keys": _plan([], keys=[], expected_token_length=0),
    "non-ASCII keys, large and negative-free ints": _plan(
        [_span(0, staging_key="rollout-é/呼び出し", carry_len=1 << 33, chunks=_chunks(5, 2))],
        keys=["rollout-é/呼び出し", "x" * 300], row_index=(1 << 31) - 1),
    "many spans (varint counts over one byte)": _plan([_span(i % 5, staging_key=f"k{i}") for i in range(130)]),
    # every varint width the writer looks up or encodes: 1 byte below 64, 2 below 8192, 3 above
    "ints at the varint widths' edges": _plan(
        [_span(0, carry_len=n, generation_len=n + 1, staged_route_len=max(n - 1, 0), boundary_token_index=n)
         for n in (0, 63, 64, 127, 128, 8191, 8192, 8193, 1 << 20, (1 << 58) + 1)]),
}


@pytest.fixture(scope="module")
def codec():
    return AvroCodec("RoutePlan")


@pytest.mark.parametrize("name", list(PLANS))
def test_written_bytes_are_the_codecs_and_the_codec_is_not_asked(codec, name, monkeypatch):
    record = PLANS[name]
    expected = codec.encode(record)
    monkeypatch.setattr(codec, "encode", lambda _r: pytest.fail("fell back to the codec"))
    assert encode_plan(codec, record) == expected
    monkeypatch.undo()
    assert codec.decode(expected) == record


@pytest.mark.parametrize("change", [
    lambda r: r.update(row_index=np.int64(3)),                          # numpy int: the codec's call
    lambda r: r["spans"][0].update(carry_len=True),                      # bool as a long
    lambda r: r["spans"][0].update(repair_previous_token=1),             # int as a boolean
    lambda r: r["spans"][1]["chunks"]["reference"].update(dtype="int4"),  # not a TensorDType
    lambda r: r["spans"][1]["chunks"]["boundary"].update(data=bytearray(768)),
    lambda r: r["spans"][0].update(extra_field=1),                       # unknown field
    lambda r: r.update(row_index=1 << 31),                               # over an Avro int
    lambda r: r["spans"][0].update(staging_key="\ud800"),                # not encodable UTF-8
    lambda r: r["spans"][1]["chunks"].pop("boundary"),                   # defaulted field left out
    lambda r: r.pop("spans"),                                            # required field missing
])
def test_anything_unexpected_is_the_codecs_to_encode_or_refuse(codec, change):
    import copy
    record = copy.deepcopy(PLANS["by reference, one and several chunks, with and without a boundary"])
    change(record)
    try:
        expected = codec.encode(record)
    except WireError as error:
        with pytest.raises(WireError) as got:
            encode_plan(codec, record)
        assert str(got.value) == str(error)
    else:
        assert encode_plan(codec, record) == expected


def test_a_plan_over_the_record_cap_fails_as_the_codec_says(codec):
    record = PLANS["many spans (varint counts over one byte)"]
    small = AvroCodec("RoutePlan", max_record_bytes=len(codec.encode(record)) - 1)
    with pytest.raises(WireError, match="max_record_bytes"):
        encode_plan(small, record)
    exact = AvroCodec("RoutePlan", max_record_bytes=len(codec.encode(record)))
    assert encode_plan(exact, record) == codec.encode(record)


def test_the_dtype_symbols_are_the_schemas_in_order(codec):
    for name, symbol in plan_writer._DTYPE.items():
        tensor = {"dtype": name, "shape": [0], "data": b""}
        record = _plan([_span(1, chunks={**_chunks(1, 1), "boundary": tensor})])
        assert encode_plan(codec, record) == codec.encode(record), name
