"""Untrusted bytes: decode returns a schema-valid dict or raises WireError, nothing else,
never hangs, never allocates for a length the input does not contain."""

from __future__ import annotations

import io
import json
import time
import tracemalloc

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from fastavro import parse_schema, schemaless_writer
from fastavro.validation import validate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage.bench.hostile import fields_bytes, zigzag
from stage.wire import AvroCodec, WireError, schema_json
from stage.wire.codec import PLAIN_PREVIOUS_FIELDS, _previous_writer
from tests.wire.samples import SAMPLES

FUZZ = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Small samples only (the 400 kB route record makes every example slow, not more thorough).
SMALL = [(n, c, b) for n, c, b in SAMPLES if c != "routes-512x48x8"]
ENCODED = {(n, c): AvroCodec(n).encode(b()) for n, c, b in SMALL}
REGISTRY = SchemaRegistryClient.new_client({"url": "mock://test"})
CONFLUENT = {n: AvroCodec(n, framing="confluent", registry=REGISTRY, subject=f"{n}-value")
             for n, _, _ in SMALL}
HEADERS = {n: CONFLUENT[n].encode(b())[:5] for n, _, b in SMALL}  # registers our schemas


def decode_or_wire_error(codec: AvroCodec, data: bytes):
    try:
        record = codec.decode(data)
    except WireError:
        return None
    # Anything else propagates and fails the test. A dict must be valid for the schema.
    assert validate(record, codec.schema, raise_errors=False)
    return record


names = st.sampled_from(sorted({n for n, _, _ in SMALL}))
cases = st.sampled_from(sorted(ENCODED))


@FUZZ
@given(name=names, data=st.binary(max_size=512))
def test_random_bytes_plain(name, data):
    decode_or_wire_error(AvroCodec(name), data)


@FUZZ
@given(name=names, body=st.binary(max_size=512), own_id=st.booleans())
def test_random_bytes_confluent(name, body, own_id):
    # With our own schema id the body reaches fastavro; otherwise the header is random too.
    data = HEADERS[name] + body if own_id else body
    decode_or_wire_error(CONFLUENT[name], data)


@pytest.mark.parametrize("case", sorted(ENCODED), ids=lambda c: "-".join(c))
def test_every_truncation_fails(case):
    codec, data = AvroCodec(case[0]), ENCODED[case]
    step = max(1, len(data) // 400)  # every prefix of the small ones, a spread of the big ones
    previous = _previous_release(case[0], codec.decode(data))
    for cut in list(range(0, len(data), step)) + [len(data) - 1]:
        if data[:cut] == previous:    # the same record as the previous release wrote it
            assert codec.decode(data[:cut])
            continue
        with pytest.raises(WireError):
            codec.decode(data[:cut])


def _previous_release(name: str, record: dict) -> bytes | None:
    """``record`` encoded as the previous release wrote it (PLAIN_PREVIOUS_FIELDS), if any."""
    if name not in PLAIN_PREVIOUS_FIELDS:
        return None
    out = io.BytesIO()
    schemaless_writer(out, _previous_writer(name),
                      {k: v for k, v in record.items() if k not in PLAIN_PREVIOUS_FIELDS[name]})
    return out.getvalue()


@FUZZ
@given(case=cases, where=st.floats(0, 1, exclude_max=True), value=st.integers(0, 255))
def test_single_byte_mutations(case, where, value):
    data = bytearray(ENCODED[case])
    data[int(where * len(data))] = value
    decode_or_wire_error(AvroCodec(case[0]), bytes(data))


@pytest.mark.parametrize("case", [c for c, d in sorted(ENCODED.items()) if len(d) <= 2048],
                         ids=lambda c: "-".join(c))
def test_every_position_mutated(case):
    codec, data = AvroCodec(case[0]), ENCODED[case]
    for at in range(len(data)):
        for value in {0x00, 0x7F, 0x80, 0xFF, data[at] ^ 0x01}:
            decode_or_wire_error(codec, data[:at] + bytes([value]) + data[at + 1:])


@FUZZ
@given(case=cases, where=st.floats(0, 1, exclude_max=True), insert=st.binary(min_size=1, max_size=9),
       delete=st.integers(0, 9))
def test_splices(case, where, insert, delete):
    data = ENCODED[case]
    at = int(where * len(data))
    decode_or_wire_error(AvroCodec(case[0]), data[:at] + insert + data[at + delete:])


def prefix(name: str, record: dict, upto: str) -> bytes:
    """Valid encoding of ``record``'s fields before ``upto`` (where the bomb goes)."""
    return fields_bytes(name, record, None, upto)


def call_record_item() -> bytes:
    """One valid manifest item (CallRecord), to repeat after a bomb count."""
    doc = json.loads(schema_json("ReceiptEvent"))
    receipt = next(f for f in doc["fields"] if f["name"] == "receipt")["type"][1]
    item = next(f for f in receipt["fields"] if f["name"] == "manifest")["type"]["items"]
    out = io.BytesIO()
    schemaless_writer(out, parse_schema(item, named_schemas={}), {
        "model_call_id": "c", "prev_len": 0, "delta_len": 1, "cum_len": 1, "weight_version": 0,
        "digest": "d", "extras_digest": "e", "staging_key": "k", "mode": "text",
        "chain_hash": "h", "cumulative_hash": "h", "response_id": "r"})
    return out.getvalue()


SUMMARY = {"group_id": "g", "group_size": 8, "prompt_idx": 1, "outcome": "complete",
           "valid_rows": 8, "total_rows": 8, "group_min_wv": 1, "group_max_wv": 1,
           "drop_reason": None, "canonical_output_tokens": 10}
RECEIPT_HEAD = {"group_id": "g", "rollout_id": "r", "rollout_index": 0, "group_size": 1,
                "prompt_idx": 0, "reward": 0.0, "mask_sample": False, "loss_multiplier": 1.0,
                "fallback_weight_version": 0, "canonical_sample_id": None, "labels": [],
                "result_stats": []}
# name -> (schema, bytes, what the error must show: the reader ran out of *input*, or the
# decode budget of an input record refused the claim before reading)
BOMBS = {
    "bytes length 2^60": ("PackedTensor", b"\x02\x00" + zigzag(2**60) + b"abc",
                          "Expected 1152921504606846976 bytes, read 3"),
    "bytes length 2^63-1": ("PackedTensor", b"\x02\x00" + zigzag(2**63 - 1) + b"abc",
                            "Expected 9223372036854775807 bytes, read 3"),
    "negative bytes length": ("PackedTensor", b"\x02\x00" + zigzag(-5) + b"abc", "Expected -5 bytes"),
    "shape array of 2^60 longs": ("PackedTensor", b"\x02" + zigzag(2**60) + b"\x02" * 64, "EOFError"),
    "negative block count, huge block size": (
        "PackedTensor", b"\x02" + zigzag(-(2**60)) + zigzag(2**62) + b"\x02" * 64, "EOFError"),
    "string length 2^60": ("LedgerEntry", zigzag(2**60) + b"g" * 32, "Expected 1152921504606846976"),
    # receipt present (union 1), versions 2/2/1, rollout_id "r", reward and terminal null
    "manifest of 2^60 calls": (
        "ReceiptEvent", prefix("ReceiptEvent", RECEIPT_HEAD, "receipt") + b"\x02\x04\x04\x02"
        + zigzag(1) + b"r\x00\x00" + zigzag(2**60) + call_record_item() * 50,
        "manifest: a block claims 1152921504606846976 items of at least 20 bytes"),
    "metrics map of 2^60 entries": (
        "GroupSummary", prefix("GroupSummary", {**SUMMARY, "rejections": [], "staging_keys": []},
                               "metrics") + zigzag(2**60) + (b"\x02a" + bytes(8)) * 50, "EOFError"),
    "rejections of 2^60 records": (
        "GroupSummary", prefix("GroupSummary", SUMMARY, "rejections") + zigzag(2**60)
        + b"\x02\x02r\x02x" * 50, "EOFError"),
    "varint of 4 kB": ("LedgerEntry", zigzag(1) + b"g" + b"\xff" * 4096, "cannot decode LedgerEntry"),
}


@pytest.mark.parametrize("name, data, shows", list(BOMBS.values()), ids=list(BOMBS))
def test_length_prefix_bombs(name, data, shows):
    codec = AvroCodec(name)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(WireError, match=shows):
            codec.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 1.0
    assert peak < 256 * 1024, f"decode allocated {peak} bytes for a {len(data)}-byte bomb"
    with pytest.raises(WireError, match=shows):  # and behind a valid Confluent header
        CONFLUENT[name].decode(HEADERS[name] + data)
