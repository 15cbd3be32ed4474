"""AvroCodec: round trips in both framings, registry ids, evolution, encode validation, caps."""

from __future__ import annotations

import io
import json

import pytest
from confluent_kafka.schema_registry import Schema, SchemaReference, SchemaRegistryClient
from fastavro import parse_schema, schemaless_writer

from stage.wire import (
    DEAD_LETTER_TOPIC,
    DEFAULT_MAX_RECORD_BYTES,
    MANAGED_MAX_MESSAGE_BYTES,
    RECORD_HEADROOM_BYTES,
    SMALL_RECORD_MAX_BYTES,
    STAGED_CALLS_TOPIC,
    TOPIC_RECORDS,
    AvroCodec,
    RegistryError,
    TopicNames,
    WireError,
    schema_json,
    unpack_tensor,
    value_subject,
)
from tests.wire.samples import SAMPLES, expected, ledger_entry, receipt_missing, staged_call_record

SUBJECT = value_subject(STAGED_CALLS_TOPIC)


class CountingRegistry:
    """The mock registry, counting the calls that reach it."""

    def __init__(self) -> None:
        self.inner = SchemaRegistryClient.new_client({"url": "mock://test"})
        self.calls: list[str] = []

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)
        return counted


@pytest.fixture
def registry():
    return CountingRegistry()


@pytest.mark.parametrize("name, case, build", SAMPLES, ids=[f"{n}-{c}" for n, c, _ in SAMPLES])
def test_plain_round_trip(name, case, build):
    record = build()
    codec = AvroCodec(name)
    assert codec.decode(codec.encode(record)) == expected(name, record)


@pytest.mark.parametrize("name, case, build", SAMPLES, ids=[f"{n}-{c}" for n, c, _ in SAMPLES])
def test_confluent_round_trip(name, case, build, registry):
    record = build()
    writer = AvroCodec(name, framing="confluent", registry=registry, subject=f"t.{name}-value")
    reader = AvroCodec(name, framing="confluent", registry=registry)
    assert writer.schema_id is None
    data = writer.encode(record)
    schema_id = registry.inner.lookup_schema(f"t.{name}-value", Schema(schema_json(name), "AVRO")).schema_id
    assert writer.schema_id == schema_id
    assert data[:5] == b"\x00" + schema_id.to_bytes(4, "big")
    assert data[5:] == AvroCodec(name).encode(record)  # the body is the plain encoding
    assert reader.decode(data) == expected(name, record)


def test_schema_ids_are_cached(registry):
    writer = AvroCodec("StagedCall", framing="confluent", registry=registry, subject=SUBJECT)
    reader = AvroCodec("StagedCall", framing="confluent", registry=registry)
    record = staged_call_record(16)
    for _ in range(3):
        reader.decode(writer.encode(record))
    assert registry.calls == ["register_schema", "get_schema"]


def test_lookup_only_writer(registry):
    writer = AvroCodec("LedgerEntry", framing="confluent", registry=registry,
                       subject="ledger-value", auto_register=False)
    with pytest.raises(RegistryError, match="subject ledger-value") as info:
        writer.encode(ledger_entry())
    assert not info.value.retriable
    registry.inner.register_schema("ledger-value", Schema(schema_json("LedgerEntry"), "AVRO"))
    assert AvroCodec("LedgerEntry", framing="confluent", registry=registry).decode(
        writer.encode(ledger_entry())) == ledger_entry()


def test_configuration_errors(registry):
    with pytest.raises(ValueError, match="framing must be"):
        AvroCodec("LedgerEntry", framing="json")
    with pytest.raises(ValueError, match="needs a Schema Registry client"):
        AvroCodec("LedgerEntry", framing="confluent")
    with pytest.raises(ValueError, match="needs subject"):
        AvroCodec("LedgerEntry", framing="confluent", registry=registry).encode(ledger_entry())


def test_unknown_schema_id_is_not_retriable_and_negatively_cached(registry):
    reader = AvroCodec("LedgerEntry", framing="confluent", registry=registry)
    data = b"\x00" + (4242).to_bytes(4, "big") + AvroCodec("LedgerEntry").encode(ledger_entry())
    for _ in range(2):
        with pytest.raises(RegistryError, match="schema id 4242") as info:
            reader.decode(data)
        assert not info.value.retriable
    assert registry.calls == ["get_schema"]


def test_registry_outage_is_retriable():
    class Down:
        def get_schema(self, schema_id):
            raise ConnectionError("registry unreachable")

    reader = AvroCodec("LedgerEntry", framing="confluent", registry=Down())
    with pytest.raises(RegistryError, match="ConnectionError") as info:
        reader.decode(b"\x00\x00\x00\x00\x01" + AvroCodec("LedgerEntry").encode(ledger_entry()))
    assert info.value.retriable


class _Refusing:
    """A registry client that answers every call with one HTTP status (as SchemaRegistryError)."""

    def __init__(self, status: int) -> None:
        self.status = status

    def _raise(self, *args, **kwargs):
        from confluent_kafka.schema_registry.error import SchemaRegistryError
        raise SchemaRegistryError(self.status, self.status * 100, f"HTTP {self.status}")

    get_schema = register_schema = lookup_schema = _raise


@pytest.mark.parametrize("status, retriable", [
    (401, True), (403, True), (408, True), (429, True), (500, True), (503, True),   # the client or an outage
    (404, False), (409, False), (422, False),                                       # the data or the schema
])
def test_registry_answers_say_whether_to_wait(status, retriable):
    reader = AvroCodec("LedgerEntry", framing="confluent", registry=_Refusing(status))
    with pytest.raises(RegistryError) as info:
        reader.decode(b"\x00\x00\x00\x00\x01" + AvroCodec("LedgerEntry").encode(ledger_entry()))
    assert (info.value.retriable, info.value.status) == (retriable, status)
    writer = AvroCodec("LedgerEntry", framing="confluent", registry=_Refusing(status), subject="s-value")
    with pytest.raises(RegistryError) as info:
        writer.ensure_registered()
    assert (info.value.retriable, info.value.status) == (retriable, status)


@pytest.mark.parametrize("data, message", [
    (b"\x00\x00\x00", "3 bytes is shorter than the 5-byte Confluent header"),
    (b"\x01" + bytes(20), r"magic byte 0x01 is not 0x00"),
    (b"\x7b" + bytes(20), r"magic byte 0x7b is not 0x00"),
])
def test_framing_errors(data, message, registry):
    with pytest.raises(WireError, match=message):
        AvroCodec("LedgerEntry", framing="confluent", registry=registry).decode(data)


def _register_writer(registry, subject, doc) -> bytes:
    schema_id = registry.inner.register_schema(subject, Schema(json.dumps(doc), "AVRO"))
    return b"\x00" + schema_id.to_bytes(4, "big")


def _write(header, doc, record) -> bytes:
    out = io.BytesIO(header)
    out.seek(len(header))
    schemaless_writer(out, parse_schema(doc, named_schemas={}), record)
    return out.getvalue()


def test_old_writer_without_defaulted_fields_decodes_with_defaults(registry):
    # An older producer: StagedCall before route_encoding, media and topk existed.
    old = json.loads(schema_json("StagedCall"))
    old["fields"] = [f for f in old["fields"] if f["name"] not in ("route_encoding", "media", "topk")]
    record = staged_call_record(32)
    record.pop("route_encoding", None)
    data = _write(_register_writer(registry, SUBJECT, old), old, record)
    decoded = AvroCodec("StagedCall", framing="confluent", registry=registry).decode(data)
    assert decoded["route_encoding"] == 0 and decoded["media"] is None and decoded["topk"] is None
    assert decoded == expected("StagedCall", record)
    assert unpack_tensor(decoded["token_ids_delta"]).shape == (32,)


def test_newer_writer_field_is_skipped(registry):
    new = json.loads(schema_json("LedgerEntry"))
    new["fields"].append({"name": "stage_version", "type": "string", "default": ""})
    data = _write(_register_writer(registry, "ledger-value", new), new,
                  {**ledger_entry(), "stage_version": "0.2.0"})
    assert AvroCodec("LedgerEntry", framing="confluent", registry=registry).decode(data) == ledger_entry()


def test_incompatible_writer_is_a_wire_error(registry):
    old = json.loads(schema_json("LedgerEntry"))
    old["fields"] = [f for f in old["fields"] if f["name"] != "output_digest"]  # no default
    record = {k: v for k, v in ledger_entry().items() if k != "output_digest"}
    data = _write(_register_writer(registry, "ledger-value", old), old, record)
    with pytest.raises(WireError, match="cannot decode LedgerEntry"):
        AvroCodec("LedgerEntry", framing="confluent", registry=registry).decode(data)


@pytest.mark.parametrize("writer_doc, reason", [
    ({"type": "record", "name": "rollout_reassembler.v1.LedgerEntry",
      "fields": [{"name": "next", "type": ["null", "rollout_reassembler.v1.LedgerEntry"]}]},
     "recursive type"),
    ({"type": "record", "name": "rollout_reassembler.v1.LedgerEntry",
      "fields": [{"name": "pad", "type": {"type": "array", "items": "null"}}]},
     "zero bytes"),
])
def test_unbounded_writer_schema_is_refused_before_reading(writer_doc, reason, registry):
    header = _register_writer(registry, "ledger-value", writer_doc)
    bomb = header + b"\x02" * 100_000 + b"\x00"  # would segfault / loop 2^60 times if read
    with pytest.raises(WireError, match=reason):
        AvroCodec("LedgerEntry", framing="confluent", registry=registry).decode(bomb)


def test_non_avro_or_referencing_writer_schema(registry):
    class Stub:
        def __init__(self, **kw):
            self.kw = kw

        def get_schema(self, schema_id):
            return Schema(**self.kw)

    data = b"\x00\x00\x00\x00\x07" + AvroCodec("LedgerEntry").encode(ledger_entry())
    proto = AvroCodec("LedgerEntry", framing="confluent",
                      registry=Stub(schema_str="syntax", schema_type="PROTOBUF"))
    for _ in range(2):  # the refusal is cached and raised again
        with pytest.raises(WireError, match="schema id 7 is PROTOBUF, not AVRO"):
            proto.decode(data)
    with pytest.raises(WireError, match="not a valid Avro schema"):
        AvroCodec("LedgerEntry", framing="confluent",
                  registry=Stub(schema_str="{nope", schema_type="AVRO")).decode(data)
    with pytest.raises(WireError, match="uses schema references"):
        AvroCodec("LedgerEntry", framing="confluent", registry=Stub(
            schema_str=schema_json("LedgerEntry"), schema_type="AVRO",
            references=[SchemaReference("GroupOutcome", "outcome-value", 1)])).decode(data)


def _bad(path, value):
    record = staged_call_record(8)
    node = record
    *parents, last = path
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return record


@pytest.mark.parametrize("record, message", [
    (_bad(["token_ids_delta", "shape", 0], 8.0),
     r"^StagedCall.token_ids_delta.shape\[0\]: expected long, got float 8.0$"),
    (_bad(["token_mask_delta", "dtype"], "float128"),
     r"^StagedCall.token_mask_delta.dtype: str 'float128' is not a symbol of rollout_reassembler.v1.TensorDType"),
    (_bad(["prev_len"], 2**63), r"^StagedCall.prev_len: expected long, got int 9223372036854775808$"),
    (_bad(["schema_version"], 2**31), r"^StagedCall.schema_version: expected int, got int 2147483648$"),
    (_bad(["digest"], KeyError), r"^StagedCall.digest: missing \(the field has no default\)$"),
    (_bad(["digset"], "ab"), r"^StagedCall.digset: not a field of rollout_reassembler.v1.StagedCall$"),
    (_bad(["routed_experts"], "x"), r"^StagedCall.routed_experts: str 'x' matches no branch"),
    (_bad(["routed_experts"], {"dtype": "int16", "shape": [1], "data": "zz"}),
     r"^StagedCall.routed_experts.data: expected bytes, got str 'zz'$"),
    (_bad(["token_ids_delta", "data"], "x" * 10_000),
     r"^StagedCall.token_ids_delta.data: expected bytes, got str 'x{59}\.\.\.$"),
])
def test_encode_names_the_bad_field(record, message):
    with pytest.raises(WireError, match=message) as info:
        AvroCodec("StagedCall").encode(record)
    assert info.value.field.startswith("StagedCall.")


def test_encode_nested_array_path():
    from tests.wire.samples import receipt_event_record

    record = receipt_event_record(8)
    record["receipt"]["manifest"][5]["weight_version"] = None
    with pytest.raises(WireError, match=r"^ReceiptEvent.receipt.manifest\[5\].weight_version: expected long"):
        AvroCodec("ReceiptEvent").encode(record)


def test_omitted_defaults_are_filled():
    out = AvroCodec("ReceiptEvent").decode(AvroCodec("ReceiptEvent").encode(receipt_missing()))
    assert out["mask_sample"] is False and out["loss_multiplier"] == 1.0 and out["labels"] == []
    assert out["canonical_sample_id"] is None and out["fallback_weight_version"] == 0


def test_max_record_bytes_on_both_sides():
    record = staged_call_record(512, routes=(48, 8))
    size = len(AvroCodec("StagedCall").encode(record))
    with pytest.raises(WireError, match=rf"StagedCall record is {size} bytes, over max_record_bytes=400000"):
        AvroCodec("StagedCall", max_record_bytes=400_000).encode(record)
    small = AvroCodec("StagedCall", max_record_bytes=1000)
    with pytest.raises(WireError, match=r"^StagedCall: 1001 bytes exceeds max_record_bytes=1000$"):
        small.decode(b"\xff" * 1001)  # refused by size alone, before any parsing


def test_default_caps_by_record_kind():
    assert AvroCodec("StagedCall").max_record_bytes == DEFAULT_MAX_RECORD_BYTES == 8_000_000
    for name in ("CanonicalRow", "RouteChunk", "PackedTensor"):
        assert AvroCodec(name).max_record_bytes == DEFAULT_MAX_RECORD_BYTES
    for name in ("ReceiptEvent", "RoutePlan", "GroupSummary", "LedgerEntry"):
        assert AvroCodec(name).max_record_bytes == SMALL_RECORD_MAX_BYTES == DEFAULT_MAX_RECORD_BYTES
    with pytest.raises(ValueError, match="must be positive"):
        AvroCodec("LedgerEntry", max_record_bytes=0)


def test_every_default_cap_fits_a_managed_kafka_topic():
    """Issue 26 item 4: with the defaults, every record of every kind, with its key, headers and
    batch framing, fits a topic whose max.message.bytes is 8 MiB (managed Kafka's limit, what
    `topics create` sets); the stage's config and the trainer's readers default to the same cap."""
    from stage.client.consuming import DEFAULT_MAX_RECORD_BYTES as reader_default
    from stage.config.model import StageConfig
    assert MANAGED_MAX_MESSAGE_BYTES == 8_388_608
    assert DEFAULT_MAX_RECORD_BYTES + RECORD_HEADROOM_BYTES <= MANAGED_MAX_MESSAGE_BYTES
    assert StageConfig().max_record_bytes == reader_default == DEFAULT_MAX_RECORD_BYTES
    for name in filter(None, TOPIC_RECORDS.values()):
        assert AvroCodec(name).max_record_bytes + RECORD_HEADROOM_BYTES <= MANAGED_MAX_MESSAGE_BYTES, name
    # the headroom holds the largest key (a group id of 4,096 characters, 4 bytes each in UTF-8)
    # and a dead letter's headers (an error of at most MAX_ERROR_BYTES and four short ones)
    from stage.decode.limits import InputLimits
    from stage.publish.deadletters import MAX_ERROR_BYTES
    assert 4 * InputLimits().max_id_chars + MAX_ERROR_BYTES + 1024 < RECORD_HEADROOM_BYTES


def test_trailing_bytes_and_non_bytes():
    data = AvroCodec("LedgerEntry").encode(ledger_entry())
    with pytest.raises(WireError, match=r"LedgerEntry: 2 trailing bytes after the record"):
        AvroCodec("LedgerEntry").decode(data + b"\x00\x00")
    with pytest.raises(WireError, match="expected bytes, got str"):
        AvroCodec("LedgerEntry").decode("text")
    assert AvroCodec("LedgerEntry").decode(memoryview(bytearray(data))) == ledger_entry()


def test_out_of_range_int_on_the_wire():
    # fastavro reads any varint into an int field; a Java reader would not, nor do we.
    entry = ledger_entry()
    wide = json.loads(schema_json("LedgerEntry"))
    next(f for f in wide["fields"] if f["name"] == "partition")["type"] = "long"
    data = _write(b"", wide, {**entry, "partition": 2**40})
    with pytest.raises(WireError, match=r"^LedgerEntry.partition: 1099511627776 does not fit the int "
                                        r"\(32-bit\) field$") as info:
        AvroCodec("LedgerEntry").decode(data)
    assert info.value.field == "LedgerEntry.partition"
    # nested, inside an array: the manifest rows' schema_version
    from tests.wire.samples import receipt_event_record

    wide = json.loads(schema_json("ReceiptEvent"))
    receipt = next(f for f in wide["fields"] if f["name"] == "receipt")["type"][1]
    call = next(f for f in receipt["fields"] if f["name"] == "manifest")["type"]["items"]
    next(f for f in call["fields"] if f["name"] == "digest_version")["type"] = "long"
    record = receipt_event_record(4)
    record["receipt"]["manifest"][2]["digest_version"] = -(2**33)
    with pytest.raises(WireError, match=r"^ReceiptEvent.receipt.manifest\[2\].digest_version: -8589934592"):
        AvroCodec("ReceiptEvent").decode(_write(b"", wide, record))


def test_topic_names():
    topics = TopicNames()
    assert topics.all() == {
        "receipts": "rollouts.receipts", "staged_calls": "rollouts.staged-calls",
        "staged_routes": "rollouts.staged-routes",
        "canonical_rows": "rollouts.canonical-rows", "route_plans": "rollouts.route-plans",
        "finalized_groups": "rollouts.finalized-groups", "dead_letter": DEAD_LETTER_TOPIC,
        "stage_ledger": "rollouts.stage-ledger"}
    assert set(TOPIC_RECORDS) == set(topics.all())
    assert TopicNames(receipts="dev.receipts").receipts == "dev.receipts"
    with pytest.raises(ValueError, match="frozen"):
        topics.receipts = "x"
    assert value_subject(topics.staged_calls) == "rollouts.staged-calls-value"


def test_large_tensor_payloads_are_spliced_into_the_same_bytes_fastavro_writes():
    """AvroCodec.encode puts payloads >= SPLICE_BYTES (and any non-bytes buffer, such as a
    numpy array's view) in after fastavro wrote the rest: the result must be fastavro's own
    encoding of the whole record, byte for byte, whatever the field order and sizes."""
    import io

    import numpy as np
    from fastavro import schemaless_writer

    from stage.wire import codec as codec_module
    from stage.wire import pack_tensor

    codec = AvroCodec("CanonicalRow", max_record_bytes=256 << 20)
    rng = np.random.default_rng(5)
    for case in range(6):
        n = int(rng.integers(1, 4000)) if case else 0
        routes = rng.integers(-1, 127, (n, 48, 8)).astype(np.int16)
        record = {
            "group_id": "g", "sample_id": "g_g0", "row_index": 0, "group_size": 4, "prompt_idx": 1,
            "rollout_id": "r0", "weight_version": 3, "group_max_wv": 4, "valid": True,
            "rejection_reason": None, "input_ids": pack_tensor(rng.integers(0, 1 << 40, n), copy=case % 2 == 0),
            "input_lengths": n, "generation_logprobs": pack_tensor(-rng.random(n).astype(np.float32), copy=False),
            "token_mask": pack_tensor(np.ones(n, np.float32)), "sample_mask": 1.0,
            "prompt_ids_for_adv": pack_tensor(np.arange(7)), "total_reward": 0.5, "mask_sample": False,
            "truncated": False, "routed_experts": pack_tensor(routes, copy=case < 3),
            "generation_topk_ids": None, "generation_topk_logprobs": None, "pixel_values": None,
            "imgs_sizes": None, "num_frames": None, "row_part": {"index": 0, "count": 2} if case == 4 else None}
        plain = {k: ({**v, "data": bytes(v["data"])} if isinstance(v, dict) and "data" in v else v)
                 for k, v in record.items()}
        expected = io.BytesIO()
        schemaless_writer(expected, codec.schema, plain, strict_allow_default=True)
        encoded = codec.encode(record)
        assert encoded == expected.getvalue()
        assert codec.decode(encoded)["routed_experts"]["data"] == routes.tobytes()
    assert codec_module.SPLICE_BYTES <= 48 * 8 * 2 * 2000   # the larger cases were spliced
