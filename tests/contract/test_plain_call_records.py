"""A receipt's manifest rows are built without a parser call per field when every value is one
its parser returns unchanged (records._plain_call_records); whatever the rows hold, the receipt
that comes back, or the error raised, is exactly the one of parsing each field."""

import copy
import math

import pytest

from stage.bench.wire import receipt_event_record
from stage.contract import RolloutReceipt
from stage.contract import records
from stage.contract.records import CallRecord

RECEIPT = receipt_event_record(3)["receipt"]
ODD = [None, True, False, 0, -1, 1, 2, 2.0, 17, "", "x", "text", "token_in", "A" * 64, "a" * 64,
       "g" * 64, "a" * 63, "a" * 65, " " + "a" * 63, math.inf, math.nan, 1.5, 10**400, [], {}]


def _outcome(raw, monkeypatch=None):
    try:
        receipt = RolloutReceipt.from_json(copy.deepcopy(raw))
    except Exception as error:   # noqa: BLE001 - the type and text are what is compared
        return type(error).__name__, str(error)
    rows = [[(name, type(getattr(r, name)).__name__, repr(getattr(r, name)))
             for name, _p, _d in CallRecord.FIELDS] for r in receipt.manifest]
    return "ok", receipt.to_json_text(), rows


def _compare(raw, monkeypatch):
    fast = _outcome(raw)
    with monkeypatch.context() as m:
        m.setattr(records, "_plain_call_records", lambda items: None)
        slow = _outcome(raw)
    assert fast == slow
    return fast


def test_a_valid_manifest_takes_the_plain_path_and_equals_parsing_each_field(monkeypatch):
    rows = records._plain_call_records(copy.deepcopy(RECEIPT["manifest"]))
    assert rows is not None and len(rows) == 3
    assert _compare(RECEIPT, monkeypatch)[0] == "ok"


@pytest.mark.parametrize("field", [f[0] for f in CallRecord.FIELDS])
def test_any_value_of_any_field_gives_what_parsing_each_field_gives(field, monkeypatch):
    outcomes = set()
    for row in (0, 2):
        for value in ODD:
            raw = copy.deepcopy(RECEIPT)
            raw["manifest"][row][field] = value
            outcomes.add(_compare(raw, monkeypatch)[0])
        raw = copy.deepcopy(RECEIPT)
        del raw["manifest"][row][field]          # a missing field (a default, or "field required")
        _compare(raw, monkeypatch)
    raw = copy.deepcopy(RECEIPT)
    raw["manifest"][1]["unknown"] = 1            # an extra field
    assert _compare(raw, monkeypatch)[0] == "WireValidationError"
    assert "WireValidationError" in outcomes


def test_model_rules_and_a_non_dict_row_give_the_same_errors(monkeypatch):
    cases = [
        {"cum_len": 1},                                    # lengths do not join
        {"delta_len": 0, "cum_len": 0, "prev_len": 0},     # empty delta
        {"parent_call_id": None},                          # a root that has a prev_len
        {"mode": "text"},                                  # a child in text mode
    ]
    for change in cases:
        raw = copy.deepcopy(RECEIPT)
        raw["manifest"][1].update(change)
        assert _compare(raw, monkeypatch)[0] == "WireValidationError"
    raw = copy.deepcopy(RECEIPT)
    raw["manifest"][1] = ["not", "a", "row"]
    assert _compare(raw, monkeypatch)[0] == "WireValidationError"
    raw["manifest"] = []
    _compare(raw, monkeypatch)
