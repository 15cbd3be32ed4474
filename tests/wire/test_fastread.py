"""The generated fast path of AvroCodec.decode (stage.wire.fastread) against the careful path
(decode budget + fastavro + int check) on the same bytes: on valid input records it is taken and
returns an equal record; on mutated, hostile and edge-case bytes it returns either None (the
careful path decides, with its own reason) or exactly what the careful path returns."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage.bench.hostile import CASES as HOSTILE
from stage.bench.hostile import fields_bytes, zigzag
from stage.wire import AvroCodec, WireError
from stage.wire.fastread import FastReader
from tests.wire.samples import SAMPLES

INPUTS = ("StagedCall", "ReceiptEvent", "RouteChunk")


def route_chunk() -> dict:
    return {"group_id": "g-1", "staging_key": "r-0/c-3", "index": 2, "count": 5,
            "sha256": "cd" * 32, "data": bytes(range(256)) * 3}


VALID = [(n, c, b) for n, c, b in SAMPLES if n in INPUTS and c != "routes-512x48x8"]
VALID.append(("RouteChunk", "chunk", route_chunk))
ENCODED = {(n, c): AvroCodec(n).encode(b()) for n, c, b in VALID}


def careful(name: str) -> AvroCodec:
    codec = AvroCodec(name)
    codec._fast = None      # the decode as it was before the fast path
    return codec


CODECS = {n: AvroCodec(n) for n in INPUTS}
CAREFUL = {n: careful(n) for n in INPUTS}


def same(a, b) -> bool:
    """Equal values of equal types (True is not 1; floats compared bit for bit, NaN included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def agrees(name: str, data: bytes) -> dict | None:
    """The fast path's record, after checking it against the careful decode of ``data``."""
    fast = CODECS[name]._fast.read(data, 0, len(data))
    if fast is not None:    # then the careful path must accept the bytes, with an equal record
        assert same(fast, CAREFUL[name].decode(data))
    return fast


def test_every_input_record_kind_has_a_fast_reader_and_outputs_have_none():
    for name in INPUTS:
        assert isinstance(CODECS[name]._fast, FastReader)
    for name in ("CanonicalRow", "GroupSummary", "LedgerEntry", "RoutePlan"):
        assert AvroCodec(name)._fast is None    # trusted: no budget, fastavro reads them


@pytest.mark.parametrize("name,case", sorted(ENCODED))
def test_valid_records_take_the_fast_path_and_equal_fastavro(name, case):
    data = ENCODED[(name, case)]
    assert agrees(name, data) is not None
    assert same(CODECS[name].decode(data), CAREFUL[name].decode(data))


def test_confluent_framing_of_our_own_schema_takes_the_fast_path():
    from confluent_kafka.schema_registry import SchemaRegistryClient
    registry = SchemaRegistryClient.new_client({"url": "mock://fastread"})
    codec = AvroCodec("StagedCall", framing="confluent", registry=registry, subject="s-value")
    record = dict(VALID[0][2]()) if VALID[0][0] == "StagedCall" else None
    data = codec.encode(record)
    assert codec._fast.read(data, 5, len(data)) is not None
    assert same(codec.decode(data), CAREFUL["StagedCall"].decode(data[5:]))


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_records_leave_the_fast_path_and_keep_their_reasons(case):
    name, build = HOSTILE[case]
    data = build(200_000)
    assert CODECS[name]._fast.read(data, 0, len(data)) is None
    with pytest.raises(WireError) as fast_error:
        CODECS[name].decode(data)
    with pytest.raises(WireError) as careful_error:
        CAREFUL[name].decode(data)
    assert str(fast_error.value) == str(careful_error.value)


def _receipt_with(field: str, value: bytes) -> bytes:
    record = dict(next(b for n, c, b in VALID if n == "ReceiptEvent")())
    after = {"rollout_index": "group_size", "mask_sample": "loss_multiplier"}[field]
    return (fields_bytes("ReceiptEvent", record, None, field) + value
            + fields_bytes("ReceiptEvent", record, after, None))


@pytest.mark.parametrize("field,value,reason", [
    ("rollout_index", zigzag(2**40), "does not fit the int (32-bit) field"),
    ("rollout_index", b"\xff" * 11 + b"\x01", ""),      # a varint past 64 bits
    ("mask_sample", b"\x02", ""),                        # a boolean byte that is not 0 or 1
])
def test_edge_values_are_left_to_the_careful_path(field, value, reason):
    data = _receipt_with(field, value)
    assert CODECS["ReceiptEvent"]._fast.read(data, 0, len(data)) is None
    try:
        expected = CAREFUL["ReceiptEvent"].decode(data)
    except WireError as e:
        assert reason in str(e)
        with pytest.raises(WireError) as fast_error:
            CODECS["ReceiptEvent"].decode(data)
        assert str(fast_error.value) == str(e)
    else:
        assert same(CODECS["ReceiptEvent"].decode(data), expected)


def test_truncated_and_extended_records_leave_the_fast_path():
    for (name, _case), data in ENCODED.items():
        for cut in (1, 2, 7, len(data) // 2, len(data) - 1):
            assert agrees(name, data[:cut]) is None
        assert agrees(name, data + b"\x00") is None


def test_memoryview_input_decodes_the_careful_way_to_the_same_record():
    data = ENCODED[("StagedCall", "full")]
    assert same(CODECS["StagedCall"].decode(memoryview(data)), CODECS["StagedCall"].decode(data))


def test_schemas_with_maps_get_no_fast_reader():
    from fastavro import parse_schema
    from stage.wire.bounds import DecodeBudget
    parsed = parse_schema({"type": "record", "name": "M", "fields": [
        {"name": "m", "type": {"type": "map", "values": "long"}}]})
    assert FastReader.build(parsed, "M", DecodeBudget(parsed, "M")) is None


def _mutate(data: bytes, rng: random.Random, ops: int = 4) -> bytes:
    """1-4 random edits: a byte replaced, a bit flipped (``ops=2``: only these), a byte
    inserted or deleted."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(out))
        op = rng.randrange(ops)
        if op == 0:
            out[at] = rng.randrange(256)
        elif op == 1:
            out[at] ^= 1 << rng.randrange(8)
        elif op == 2:
            out.insert(at, rng.randrange(256))
        elif len(out) > 1:
            del out[at]
    return bytes(out)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(sorted(ENCODED)), seed=st.integers(0, 2**32 - 1))
def test_mutated_records_agree_with_the_careful_path(case, seed):
    agrees(case[0], _mutate(ENCODED[case], random.Random(seed)))


def test_mutations_often_still_take_the_fast_path():
    """The differential test above compares records only when the fast path returns one: make
    sure that it does for a good share of records changed in place (most bytes are tensor data)."""
    rng = random.Random(5)
    taken = sum(agrees("StagedCall", _mutate(ENCODED[("StagedCall", "plain-512")], rng, ops=2))
                is not None for _ in range(300))
    assert taken > 100
