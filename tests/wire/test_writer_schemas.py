"""What a registry writer schema may change, and what happens otherwise (docs/schemas.md,
Writer schemas).

A writer schema decides only how a record's bytes are laid out; every field is read as *our*
schema types it. Logical types and other annotations of the writer are ignored (they do not
change the encoding), so a Java producer that annotates ``prompt_idx`` as ``timestamp-millis``
still delivers an int. A writer schema the stage cannot use (a ``fixed`` size that is not a
count of bytes) is refused as a schema, never taken for a registry outage: its records are dead
letters, and the operator commands report them instead of crashing.
"""

from __future__ import annotations

import io
import json

import pytest
from confluent_kafka.schema_registry import Schema
from fastavro import parse_schema, schemaless_writer
from fastavro.validation import validate

from stage.config.model import StageConfig
from stage.debug.deadletters import Replayer, group_of, input_schemas, parse
from stage.debug.kafka import Record
from stage.runtime.kafka.registry import SchemaResolver
from stage.wire import AvroCodec, RegistryError, WireError, schema_json, schema_names
from tests.wire.samples import expected, receipt_missing, staged_call_record


class Registry:
    """A registry holding schema texts by id, exactly as registered (no rendering of its own),
    counting lookups."""

    def __init__(self) -> None:
        self.texts: dict[int, str] = {}
        self.lookups = 0

    def add(self, doc) -> int:
        schema_id = 100 + len(self.texts)
        self.texts[schema_id] = doc if isinstance(doc, str) else json.dumps(doc)
        return schema_id

    def get_schema(self, schema_id: int) -> Schema:
        self.lookups += 1
        return Schema(self.texts[schema_id], "AVRO")


def _doc(name: str) -> dict:
    return json.loads(schema_json(name))


def _field(record_doc: dict, name: str) -> dict:
    return next(f for f in record_doc["fields"] if f["name"] == name)


def _with_added_field(doc: dict, field: dict | None = None) -> dict:
    """``doc`` plus one optional field: its canonical form differs from ours, so the codec
    resolves it against ours instead of reading it as ours."""
    doc["fields"].append(field or {"name": "producer_host", "type": ["null", "string"], "default": None})
    return doc


def _framed(schema_id: int, doc: dict, record: dict) -> bytes:
    out = io.BytesIO()
    out.write(b"\x00" + schema_id.to_bytes(4, "big"))
    schemaless_writer(out, parse_schema(doc, named_schemas={}), record)
    return out.getvalue()


def _reader(name: str, registry: Registry) -> AvroCodec:
    return AvroCodec(name, framing="confluent", registry=registry)


# -- item 1: logical types of the writer -------------------------------------------------------

RECEIPT_ANNOTATIONS = {
    "timestamp-millis": ("prompt_idx", {"type": "long", "logicalType": "timestamp-millis"}),
    "timestamp-micros": ("fallback_weight_version", {"type": "long", "logicalType": "timestamp-micros"}),
    "local-timestamp-millis": ("prompt_idx", {"type": "long", "logicalType": "local-timestamp-millis"}),
    "time-micros": ("prompt_idx", {"type": "long", "logicalType": "time-micros"}),
    "date": ("rollout_index", {"type": "int", "logicalType": "date"}),
    "time-millis": ("group_size", {"type": "int", "logicalType": "time-millis"}),
    "uuid": ("rollout_id", {"type": "string", "logicalType": "uuid"}),
    "unknown": ("prompt_idx", {"type": "long", "logicalType": "epoch-seconds"}),
}


@pytest.mark.parametrize("field_name, annotated", list(RECEIPT_ANNOTATIONS.values()),
                         ids=list(RECEIPT_ANNOTATIONS))
def test_a_writer_logical_type_is_read_as_our_plain_type(field_name, annotated):
    doc = _with_added_field(_doc("ReceiptEvent"))
    _field(doc, field_name)["type"] = annotated
    record = {**receipt_missing(), "prompt_idx": 1_700_000_000_123, "producer_host": "w-1"}
    registry = Registry()
    data = _framed(registry.add(doc), doc, record)
    decoded = _reader("ReceiptEvent", registry).decode(data)
    record.pop("producer_host")
    assert decoded == expected("ReceiptEvent", record)
    assert type(decoded[field_name]) is type(expected("ReceiptEvent", record)[field_name])
    assert validate(decoded, AvroCodec("ReceiptEvent").schema, raise_errors=False)


def test_logical_types_inside_nested_records_and_arrays_are_ignored_too():
    doc = _with_added_field(_doc("StagedCall"))
    packed = _field(doc, "token_ids_delta")["type"]      # PackedTensor, defined at first use
    _field(packed, "shape")["type"]["items"] = {"type": "long", "logicalType": "timestamp-millis"}
    _field(doc, "weight_version")["type"] = {"type": "long", "logicalType": "timestamp-micros"}
    record = staged_call_record(16)
    registry = Registry()
    decoded = _reader("StagedCall", registry).decode(_framed(registry.add(doc), doc, record))
    assert decoded == expected("StagedCall", record)
    assert all(type(n) is int for n in decoded["token_ids_delta"]["shape"])


# -- item 2: a decimal on tensor bytes -----------------------------------------------------

def test_a_decimal_on_tensor_bytes_is_read_as_the_bytes():
    """fastavro would build a Decimal of the payload (time quadratic in its length, on the poll
    thread); read as our ``bytes`` it is the payload itself, in one copy."""
    doc = _with_added_field(_doc("StagedCall"))
    packed = _field(doc, "token_ids_delta")["type"]
    _field(packed, "data")["type"] = {"type": "bytes", "logicalType": "decimal",
                                      "precision": 4096, "scale": 2}
    record = staged_call_record(512)
    registry = Registry()
    decoded = _reader("StagedCall", registry).decode(_framed(registry.add(doc), doc, record))
    assert decoded == expected("StagedCall", record)
    for column in ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta"):
        assert type(decoded[column]["data"]) is bytes


def test_annotations_and_promotions_a_writer_may_use():
    """Docs, aliases, orders, custom properties and defaults of the writer, fields in another
    order, an ``int`` written where we read a ``long``: the same record."""
    doc = _with_added_field(_doc("ReceiptEvent"))
    doc["doc"] = "written by a Java producer"
    doc["aliases"] = ["LegacyReceipt"]
    doc["connect.name"] = "rollout_reassembler.v1.ReceiptEvent"
    _field(doc, "reward").update({"order": "descending", "doc": "x", "default": 0.5})
    _field(doc, "group_id")["type"] = {"type": "string", "avro.java.string": "String"}
    _field(doc, "prompt_idx")["type"] = "int"
    doc["fields"].reverse()
    record = {**receipt_missing(), "producer_host": None}
    registry = Registry()
    decoded = _reader("ReceiptEvent", registry).decode(_framed(registry.add(doc), doc, record))
    record.pop("producer_host")
    assert decoded == expected("ReceiptEvent", record)


def test_our_schemas_carry_no_logical_type():
    """The writer's logical types are dropped, and fastavro converts by the writer's: were one
    of ours logical, its conversion would be lost. Keep ours plain (or revisit codec.py)."""
    def walk(node):
        if isinstance(node, dict):
            assert "logicalType" not in node, node
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    for name in schema_names():
        walk(_doc(name))


# -- item 4: a fixed size that is not a count of bytes --------------------------------------

ODD_SIZES = ["16", None, [1], True, -1, 2.5, {"n": 1}]
REFUSED = r"schema id {}: fixed '[a-z_.0-9]*TraceId' size .* is not a count of bytes"


def _trace_id(size, where: str = "field") -> dict:
    """An added field holding a fixed of ``size``: as the field's type, a union branch or an
    array's items."""
    fixed = {"type": "fixed", "name": "TraceId", "size": size}
    kind = {"field": fixed, "union": ["null", fixed], "array": {"type": "array", "items": fixed}}[where]
    return {"name": "trace_id", "type": kind}


def _our_body_under(schema_id: int) -> bytes:
    """A receipt of ours framed with ``schema_id`` (what follows does not matter: the schema
    is refused before any byte is read)."""
    return b"\x00" + schema_id.to_bytes(4, "big") + AvroCodec("ReceiptEvent").encode(receipt_missing())


@pytest.mark.parametrize("where", ["field", "union", "array"])
@pytest.mark.parametrize("size", ODD_SIZES, ids=repr)
def test_a_fixed_size_that_is_not_a_count_is_a_schema_refusal(size, where):
    doc = _with_added_field(_doc("ReceiptEvent"), _trace_id(size, where))
    registry = Registry()
    schema_id = registry.add(doc)
    data = _our_body_under(schema_id)
    for budget in (True, False):               # the input records' codecs and the others'
        codec = AvroCodec("ReceiptEvent", framing="confluent", registry=registry, budget=budget)
        codec.prefetch(schema_id)              # a refusal is an answer, not an outage
        for _ in range(2):                     # and it is remembered
            with pytest.raises(WireError, match=REFUSED.format(schema_id)) as info:
                codec.decode(data, fetch=False)
            assert not isinstance(info.value, RegistryError)
    assert registry.lookups == 2


def test_the_resolver_releases_a_partition_whose_writer_schema_is_refused():
    doc = _with_added_field(_doc("StagedCall"), _trace_id("16"))
    registry = Registry()
    schema_id = registry.add(doc)
    resolver = SchemaResolver(min_backoff_s=0.0)
    try:
        resolver.request(_reader("StagedCall", registry), schema_id, partition=3)
        resolver.requests[("StagedCall", schema_id)].future.result(timeout=30)
        assert resolver.poll() == {3}          # fetched again, then dead-lettered
        assert not resolver.unavailable and resolver.last_error is None
    finally:
        resolver.close()


def test_the_dead_letter_tools_report_a_refused_writer_schema():
    """``dead-letters list`` (group_of) and ``replay`` (Replayer.plan) decode with the same
    codecs: the refusal is their answer, not a TypeError."""
    doc = _with_added_field(_doc("ReceiptEvent"), _trace_id([1]))
    registry = Registry()
    schema_id = registry.add(doc)
    value = _our_body_under(schema_id)
    cfg = StageConfig(bootstrap_servers="unused:9092")
    headers = [("source-topic", cfg.topics.receipts.encode()), ("source-partition", b"0"),
               ("source-offset", b"7"), ("error", b"WireError: ..."), ("error-class", b"undecodable")]
    view = parse(Record(cfg.topics.dead_letter, 0, 12, 0, b"g", value, headers))
    codecs = {"ReceiptEvent": _reader("ReceiptEvent", registry)}
    assert group_of(view, codecs, input_schemas(cfg)) is None
    replayer = Replayer(cfg, None, codecs, log_topic="unused", dry_run=True)
    status, detail, target = replayer.plan(view)
    assert (status, target) == ("refused", None)
    assert "TraceId' size [1] is not a count of bytes" in detail
