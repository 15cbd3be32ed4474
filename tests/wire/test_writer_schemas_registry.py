"""Writer schemas through a real registry (Apicurio, tests/conftest.py ``apicurio``): the schema
text the codec reads back is the registry's rendering, not ours (Apicurio returns Avro's
``toString`` form), and the records of a writer with logical types still decode as ours.
A ``fixed`` size that is not an int is refused by the registry or, if it stores it, by the
codec, as a schema (never a registry outage)."""

from __future__ import annotations

import io
import json
import uuid

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from fastavro import parse_schema, schemaless_writer

from stage.wire import AvroCodec, RegistryError, WireError, schema_json
from tests.wire.samples import expected, receipt_missing, staged_call_record


def _field(doc: dict, name: str) -> dict:
    return next(f for f in doc["fields"] if f["name"] == name)


def _framed(schema_id: int, doc: dict, record: dict) -> bytes:
    out = io.BytesIO(b"\x00" + schema_id.to_bytes(4, "big"))
    out.seek(5)
    schemaless_writer(out, parse_schema(doc, named_schemas={}), record)
    return out.getvalue()


def test_logical_type_writers_registered_in_apicurio_decode_as_ours(apicurio):
    client = SchemaRegistryClient({"url": apicurio.url, "basic.auth.user.info": apicurio.user_info})
    added = {"name": "producer_host", "type": ["null", "string"], "default": None}
    receipt = json.loads(schema_json("ReceiptEvent"))
    receipt["fields"].append(added)
    _field(receipt, "prompt_idx")["type"] = {"type": "long", "logicalType": "timestamp-millis"}
    staged = json.loads(schema_json("StagedCall"))
    staged["fields"].append(added)
    packed = _field(staged, "token_ids_delta")["type"]
    _field(packed, "data")["type"] = {"type": "bytes", "logicalType": "decimal", "precision": 4096, "scale": 2}
    run = uuid.uuid4().hex[:8]
    cases = [("ReceiptEvent", receipt, {**receipt_missing(), "prompt_idx": 1_700_000_000_123}),
             ("StagedCall", staged, staged_call_record(512))]
    for name, doc, record in cases:
        schema_id = client.register_schema(f"writer-{run}-{name}-value", Schema(json.dumps(doc), "AVRO"))
        assert "logicalType" in client.get_schema(schema_id).schema_str   # kept by the registry
        codec = AvroCodec(name, framing="confluent", registry=client)
        decoded = codec.decode(_framed(schema_id, doc, {**record, "producer_host": "w-1"}))
        assert decoded == expected(name, record)
    assert type(decoded["token_ids_delta"]["data"]) is bytes


def test_a_fixed_size_that_is_not_a_count_through_apicurio(apicurio):
    client = SchemaRegistryClient({"url": apicurio.url, "basic.auth.user.info": apicurio.user_info})
    doc = json.loads(schema_json("ReceiptEvent"))
    doc["fields"].append({"name": "trace_id", "type": {"type": "fixed", "name": "TraceId", "size": "16"}})
    try:
        schema_id = client.register_schema(f"writer-{uuid.uuid4().hex[:8]}-odd-value",
                                           Schema(json.dumps(doc), "AVRO"))
    except SchemaRegistryError as error:   # the registry validates: nothing reaches the stage
        assert 400 <= error.http_status_code < 500
        return
    codec = AvroCodec("ReceiptEvent", framing="confluent", registry=client)
    codec.prefetch(schema_id)
    data = b"\x00" + schema_id.to_bytes(4, "big") + AvroCodec("ReceiptEvent").encode(receipt_missing())
    with pytest.raises(WireError, match="size '16' is not a count of bytes") as info:
        codec.decode(data, fetch=False)
    assert not isinstance(info.value, RegistryError)
