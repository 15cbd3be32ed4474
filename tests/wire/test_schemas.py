"""Loading the contract: dependency order, self-contained registry text, the safety walk."""

from __future__ import annotations

import json
import shutil

from pathlib import Path

import pytest
from fastavro import parse_schema

from stage.wire import SCHEMAS_DIR_ENV, WireError, schema, schema_json, schema_names, schemas_dir
from stage.wire.guard import check_decodable, find_error, named_types

ALL = ("CanonicalRow", "GroupSummary", "LedgerEntry", "PackedTensor", "ReceiptEvent",
       "RouteChunk", "RoutePlan", "StagedCall")


def test_every_schema_loads_in_dependency_order():
    names = schema_names()
    assert sorted(names) == sorted(ALL)
    assert names.index("PackedTensor") < names.index("StagedCall")
    assert names.index("PackedTensor") < names.index("CanonicalRow")
    assert names.index("GroupSummary") < names.index("LedgerEntry")
    # the package's copy is the repository's top-level schemas/ (a link in a source checkout)
    assert schemas_dir().resolve() == (Path(__file__).resolve().parents[2] / "schemas")
    assert schema("StagedCall")["name"] == "rollout_reassembler.v1.StagedCall"


@pytest.mark.parametrize("name", ALL)
def test_schema_json_is_self_contained(name):
    text = schema_json(name)
    parsed = parse_schema(json.loads(text), named_schemas={})  # no other file needed
    assert parsed["name"] == f"rollout_reassembler.v1.{name}"
    assert json.loads(text) == json.loads(schema_json(name))  # stable text for the registry


def test_shared_types_are_inlined_once_with_their_namespace():
    staged = json.loads(schema_json("StagedCall"))
    tensor_defs = [f for f in staged["fields"] if isinstance(f["type"], dict)
                   and f["type"].get("name") == "PackedTensor"]
    assert [f["name"] for f in tensor_defs] == ["token_ids_delta"]  # defined at first use
    assert tensor_defs[0]["type"]["namespace"] == "rollout_reassembler.v1"
    by_name = {f["name"]: f["type"] for f in staged["fields"]}
    assert by_name["token_mask_delta"] == "rollout_reassembler.v1.PackedTensor"  # then referenced
    ledger = {f["name"]: f["type"] for f in json.loads(schema_json("LedgerEntry"))["fields"]}
    assert ledger["outcome"]["symbols"] == ["complete", "deadline", "dropped"]


def test_unknown_schema_name():
    with pytest.raises(KeyError, match="no schema 'Nope'"):
        schema("Nope")


def _copy_schemas(tmp_path, monkeypatch, drop=()):
    for path in schemas_dir().glob("*.avsc"):
        if path.stem not in drop:
            shutil.copy(path, tmp_path / path.name)
    monkeypatch.setenv(SCHEMAS_DIR_ENV, str(tmp_path))
    return tmp_path


def test_env_override_and_missing_definition(tmp_path, monkeypatch):
    _copy_schemas(tmp_path, monkeypatch, drop=("GroupSummary",))
    assert schemas_dir() == tmp_path
    with pytest.raises(WireError, match=r"LedgerEntry.avsc uses rollout_reassembler.v1.GroupOutcome, "
                                        "which no schema file defines"):
        schema_names()


def test_invalid_json_names_the_file(tmp_path, monkeypatch):
    _copy_schemas(tmp_path, monkeypatch)
    (tmp_path / "RoutePlan.avsc").write_text('{"type": "record",, }')
    with pytest.raises(WireError, match=r"RoutePlan.avsc: invalid JSON"):
        schema("RoutePlan")


def test_redefinition_is_refused(tmp_path, monkeypatch):
    _copy_schemas(tmp_path, monkeypatch)
    (tmp_path / "Dup.avsc").write_text(json.dumps(
        {"type": "record", "name": "PackedTensor", "namespace": "rollout_reassembler.v1",
         "fields": []}))
    with pytest.raises(WireError, match=r"redefines rollout_reassembler.v1.PackedTensor"):
        schema_names()


@pytest.mark.parametrize("bad, reason", [
    ({"type": "record", "name": "N", "fields": [{"name": "next", "type": ["null", "N"]}]},
     "recursive type N"),
    ({"type": "record", "name": "A", "fields": [{"name": "xs", "type": {"type": "array", "items": "null"}}]},
     "array items encode in zero bytes"),
    ({"type": "record", "name": "B", "fields": [{"name": "xs", "type": {"type": "array", "items":
        {"type": "record", "name": "E", "fields": []}}}]}, "array items encode in zero bytes"),
])
def test_check_decodable_refuses_unbounded_schemas(bad, reason):
    with pytest.raises(WireError, match=reason):
        check_decodable(parse_schema(bad, named_schemas={}), "writer")


def test_find_error_paths():
    s = schema("ReceiptEvent")
    from tests.wire.samples import receipt_event_record

    record = receipt_event_record(4)
    record["receipt"]["manifest"][2]["prev_len"] = "7"
    assert find_error(s, record, "ReceiptEvent", named_types(s)) == (
        "ReceiptEvent.receipt.manifest[2].prev_len", "expected long, got str '7'")
