"""The decode budget of the input records: a hostile record is refused before fastavro builds
its objects, memory per record stays under ~20x its size (tracemalloc), legitimate records
decode, and the walk agrees with fastavro about where every record ends."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from fastavro import parse_schema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage.bench.hostile import CASES, fields_bytes, zigzag
from stage.bench.wire import receipt_event_record
from stage.wire import INPUT_RECORDS, SMALL_RECORD_MAX_BYTES, AvroCodec, WireError, record_cap, schema_json
from stage.wire.bounds import BUDGET_SLACK, DecodeBudget
from tests.wire.samples import SAMPLES

MiB = 1 << 20
# The bound the budget promises: ~20x the record, plus a constant for a record's fixed parts.
RATIO_BOUND = 20
FIXED_BYTES = 2 * BUDGET_SLACK


def traced_peak(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        try:
            result = fn()
        except WireError as e:
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_issue_18_receipt_of_empty_labels_is_refused_before_decoding():
    data = CASES["ReceiptEvent: empty labels, one block"][1](2 * MiB)   # 1,048,576 labels
    codec = AvroCodec("ReceiptEvent", max_record_bytes=64 * MiB)   # what the runtime passes
    error, peak = traced_peak(lambda: codec.decode(data))
    assert isinstance(error, WireError)
    assert error.field == "ReceiptEvent.labels" and "1048576 items would decode" in str(error)
    assert peak < 64 * 1024, f"{peak} bytes traced to refuse a {len(data)}-byte record"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("size", [4096, 64 * 1024, 512 * 1024])
def test_hostile_record_costs_at_most_20x_its_size(case, size):
    name, build = CASES[case]
    data = build(size)
    codec = AvroCodec(name, max_record_bytes=64 * MiB)
    result, peak = traced_peak(lambda: codec.decode(data))
    assert peak <= RATIO_BOUND * len(data) + FIXED_BYTES, (
        f"{case}: {peak} bytes traced for {len(data)} bytes ({peak / len(data):.0f}x): {result}")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("size", [4096, 64 * 1024, 512 * 1024])
def test_cost_model_is_an_upper_bound_of_the_decode(case, size):
    """What the walk estimates (budget lifted so it accepts) is at least what fastavro's decode
    allocates: a record the budget accepts costs at most 16x its size + 64 KiB."""
    name, build = CASES[case]
    data = build(size)
    codec = AvroCodec(name, max_record_bytes=64 * MiB, budget=False)
    estimate = DecodeBudget(codec.schema, name, ratio=10**6).check(data, 0, len(data))
    _, peak = traced_peak(lambda: codec.decode(data))
    assert peak <= estimate, f"{case}: decode traced {peak} bytes, the walk estimated {estimate}"


@pytest.mark.parametrize("name, case, build", [s for s in SAMPLES if s[0] in INPUT_RECORDS],
                         ids=[f"{n}-{c}" for n, c, _ in SAMPLES if n in INPUT_RECORDS])
def test_cost_model_bounds_legitimate_records(name, case, build):
    codec = AvroCodec(name, budget=False)
    data = codec.encode(build())
    estimate = AvroCodec(name).decode_budget.check(data, 0, len(data))
    _, peak = traced_peak(lambda: codec.decode(data))
    assert peak <= estimate <= 16 * len(data) + BUDGET_SLACK


def test_receipts_keep_their_own_cap_under_any_max_record_bytes():
    assert record_cap("ReceiptEvent", 64 * MiB) == SMALL_RECORD_MAX_BYTES
    assert record_cap("ReceiptEvent", 1 * MiB) == 1 * MiB
    assert record_cap("StagedCall", 256 * MiB) == 256 * MiB
    codec = AvroCodec("ReceiptEvent", max_record_bytes=64 * MiB)
    assert codec.max_record_bytes == SMALL_RECORD_MAX_BYTES
    data = CASES["ReceiptEvent: empty labels, one block"][1](SMALL_RECORD_MAX_BYTES + 16)
    error, peak = traced_peak(lambda: codec.decode(data))
    assert isinstance(error, WireError) and f"exceeds max_record_bytes={SMALL_RECORD_MAX_BYTES}" in str(error)
    assert peak < 4096
    with pytest.raises(WireError, match=f"over max_record_bytes={SMALL_RECORD_MAX_BYTES}"):   # and the producer
        codec.encode({**receipt_event_record(1), "rollout_id": "r" * SMALL_RECORD_MAX_BYTES})


def test_largest_legitimate_receipts_decode():
    record = receipt_event_record(512)
    record["labels"] = [{"scope": "s", "name": f"{i}"} for i in range(32)]
    record["result_stats"] = [{"field": f"{i}", "sum": 1.0, "count": 1} for i in range(128)]
    codec = AvroCodec("ReceiptEvent")
    assert codec.decode(codec.encode(record))["labels"] == record["labels"]
    empty = {**receipt_event_record(1), "labels": [{"scope": "", "name": ""}] * 32,
             "result_stats": [{"field": "", "sum": 0.0, "count": 0}] * 128}
    assert len(codec.decode(codec.encode(empty))["result_stats"]) == 128


@pytest.mark.parametrize("name, case, build", SAMPLES, ids=[f"{n}-{c}" for n, c, _ in SAMPLES])
def test_walk_ends_where_the_record_ends(name, case, build):
    """Every schema, budget forced on: the walk accepts each sample and ends at its end."""
    codec = AvroCodec(name, budget=True)
    data = codec.encode(build())
    assert codec.decode(data) is not None
    with pytest.raises(WireError, match="runs|ends inside|length"):
        codec.decode_budget.check(data[:-1], 0, len(data) - 1)


def test_outputs_and_inputs_default():
    assert INPUT_RECORDS == {"StagedCall", "ReceiptEvent", "RouteChunk"}
    assert all(AvroCodec(n).decode_budget is not None for n in INPUT_RECORDS)
    assert AvroCodec("GroupSummary").decode_budget is None   # the stage's own output


SMALL = [(n, b) for n, c, b in SAMPLES if n in INPUT_RECORDS and c != "routes-512x48x8"]
ENCODED = [(n, AvroCodec(n).encode(b())) for n, b in SMALL]
STRUCTURAL = ("ends inside", "runs", "length", "claims", "union index")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(0, len(ENCODED) - 1), where=st.floats(0, 1, exclude_max=True),
       insert=st.binary(max_size=10), delete=st.integers(0, 10))
def test_walk_refuses_only_what_fastavro_refuses(case, where, insert, delete):
    """A structural refusal of the walk is never a record fastavro would have decoded."""
    name, data = ENCODED[case]
    at = int(where * len(data))
    data = data[:at] + insert + data[at + delete:]
    codec = AvroCodec(name)
    try:
        codec.decode_budget.check(data, 0, len(data))
    except WireError as e:
        if any(s in str(e) for s in STRUCTURAL):
            try:
                AvroCodec(name, budget=False).decode(data)
            except WireError:
                return
            # decoded only as a record of the previous release (PLAIN_PREVIOUS_FIELDS), which
            # its own walk accepts
            codec._previous_budget.check(data, 0, len(data))
        return
    try:
        AvroCodec(name, budget=False).decode(data)
    except WireError:
        pass   # the walk accepts some garbage (an enum index, trailing bytes): fastavro refuses


def _registry_header(registry, doc) -> bytes:
    schema_id = registry.register_schema("receipts-value", Schema(json.dumps(doc), "AVRO"))
    return b"\x00" + schema_id.to_bytes(4, "big")


def test_registry_writer_schema_gets_its_own_walk():
    """A writer schema that differs from ours (an extra field, before labels) is walked by its
    own layout, and the fields our schema adds by default are costed."""
    registry = SchemaRegistryClient.new_client({"url": "mock://bounds"})
    doc = json.loads(schema_json("ReceiptEvent"))
    at = [f["name"] for f in doc["fields"]].index("labels")
    doc["fields"].insert(at, {"name": "tenant", "type": "string", "default": ""})
    header = _registry_header(registry, doc)
    codec = AvroCodec("ReceiptEvent", framing="confluent", registry=registry)
    record = receipt_event_record(2)
    good = (header + fields_bytes("ReceiptEvent", record, None, "labels") + zigzag(1) + b"t"
            + fields_bytes("ReceiptEvent", record, "labels", None))
    assert codec.decode(good)["labels"] == record["labels"]
    n = 1 << 18
    bomb = (header + fields_bytes("ReceiptEvent", record, None, "labels") + zigzag(1) + b"t"
            + zigzag(n) + b"\x00\x00" * n + b"\x00"
            + fields_bytes("ReceiptEvent", record, "result_stats", None))
    error, peak = traced_peak(lambda: codec.decode(bomb))
    assert isinstance(error, WireError) and error.field.startswith("ReceiptEvent (schema id")
    assert peak < 256 * 1024


def test_deeply_nested_writer_schema_is_walked_or_refused():
    """Anonymous nesting deeper than Python's 20 nested blocks moves into functions."""
    node: object = "long"
    for _ in range(40):
        node = {"type": "array", "items": ["null", node]}
    doc = {"type": "record", "name": "Deep", "fields": [{"name": "x", "type": node}]}
    budget = DecodeBudget(parse_schema(doc, named_schemas={}), "Deep")
    data = b"\x00"   # an empty outer array
    budget.check(data, 0, len(data))
    nested = b"".join(b"\x02\x02" for _ in range(40)) + b"\x02" + b"\x00" * 40
    budget.check(nested, 0, len(nested))
    with pytest.raises(WireError):
        budget.check(nested[:-1], 0, len(nested) - 1)


def test_schema_too_deep_for_the_generator_is_a_wire_error():
    node: object = "long"
    for _ in range(3000):
        node = {"type": "array", "items": node}
    parsed = parse_schema({"type": "record", "name": "Deep", "fields": [{"name": "x", "type": node}]},
                          named_schemas={})
    with pytest.raises(WireError, match="too deeply nested to vet"):
        DecodeBudget(parsed, "Deep")


INJECTED: list = []


def test_writer_schema_text_never_becomes_code():
    """fastavro accepts any field name and a string as a fixed size: none of it may reach the
    generated walk as code."""
    code = "import tests.wire.test_bounds as t; t.INJECTED.append(1)"
    fields = [{"name": f"x\n    {code}\n    #", "type": "long"}]
    budget = DecodeBudget(parse_schema({"type": "record", "name": "R", "fields": fields},
                                       named_schemas={}), "R")
    budget.check(b"\x02", 0, 1)
    assert INJECTED == [] and f"\n    {code}\n" not in budget.source
    sized = [{"name": "f", "type": {"type": "fixed", "name": "F",
                                    "size": f"1\n    {code.replace('(1)', '(2)')}\n"}}]
    with pytest.raises(WireError, match="is not a count of bytes"):
        DecodeBudget(parse_schema({"type": "record", "name": "S", "fields": sized},
                                  named_schemas={}), "S")
    assert INJECTED == []
