"""Route plan: classification table, validation messages, strict codec, size."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stage.contract import classify_route_span
from stage.routes import (
    ROUTE_PLAN_FIELDS,
    ROUTE_SPAN_FIELDS_V2,
    ROUTE_SPAN_FIELDS_V3,
    RouteAssemblyPlan,
    decode_route_plan,
    dumps_route_plan,
    encode_route_plan,
    encoded_route_plan_size_bytes,
    loads_route_plan,
    placeholder_route_plan,
    validate_route_plan,
    validated_route_plan_size_bytes,
)
from tests.routes.factory import DIGEST, PARTITION, plan, raises_exact, span


def boundary_plan(schema=3):
    return plan([span("r/c1", 2, 2, 4), span("r/c2", 1, 2, 3, index=3, repair=True)], schema=schema)


# --- classification (Gym decision table, spec §3.3 examples) -----------------------------


@pytest.mark.parametrize(
    "carry,gen,staged,mode",
    [(2, 2, 4, "full"), (3, 1, 1, "tail"), (0, 0, 0, "sentinel"), (1, 1, 0, "sentinel"),
     (1, 2, 5, "tail"), (1, 3, 2, "sentinel")],
)
def test_classify_route_span(carry, gen, staged, mode):
    assert classify_route_span(carry_len=carry, generation_len=gen, staged_route_len=staged) == mode


# --- validation: every message -----------------------------------------------------------

GOOD = plan([span("r/c1", 2, 2, 4), span("r/c2", 1, 2, 3)])


@pytest.mark.parametrize(
    "changes,exc,message",
    [
        ({"schema_version": 999}, ValueError,
         "unsupported route plan schema version 999; expected 2 (legacy) or 3"),
        ({"schema_version": True}, ValueError,
         "unsupported route plan schema version True; expected 2 (legacy) or 3"),
        ({"staging_partition": ""}, TypeError, "route_plan.staging_partition must be a non-empty string"),
        ({"staging_partition": None}, TypeError, "route_plan.staging_partition must be a non-empty string"),
        ({"expected_token_length": True}, TypeError, "route_plan.expected_token_length must be int, got bool"),
        ({"expected_token_length": 7.0}, TypeError, "route_plan.expected_token_length must be int, got float"),
        ({"expected_token_length": -1}, ValueError, "route_plan.expected_token_length must be non-negative, got -1"),
        ({"expected_token_length": 9}, ValueError, "route plan spans contribute 7 tokens, expected 9"),
        ({"cleanup_staging_keys": ("r/c1", "r/c2", "r/c1")}, ValueError,
         "route_plan.cleanup_staging_keys contains duplicates"),
        ({"cleanup_staging_keys": ("r/c1", "")}, TypeError,
         "route_plan.cleanup_staging_keys[1] must be a non-empty string"),
        ({"cleanup_staging_keys": ("r/c1",)}, ValueError,
         "route_plan.spans[1] key 'r/c2' is outside cleanup_staging_keys"),
    ],
)
def test_validate_plan_fields(changes, exc, message):
    with raises_exact(exc, message):
        validate_route_plan(replace(GOOD, **changes))


@pytest.mark.parametrize(
    "changes,exc,message",
    [
        ({"staging_key": ""}, TypeError, "route_plan.spans[1].staging_key must be a non-empty string"),
        ({"carry_len": -1}, ValueError, "route_plan.spans[1].carry_len must be non-negative, got -1"),
        ({"generation_len": 2.0}, TypeError, "route_plan.spans[1].generation_len must be int, got float"),
        ({"staged_route_len": True}, TypeError, "route_plan.spans[1].staged_route_len must be int, got bool"),
        ({"extras_digest_version": 2}, ValueError, "route_plan.spans[1].extras_digest_version must be 1"),
        ({"extras_digest_version": True}, ValueError, "route_plan.spans[1].extras_digest_version must be 1"),
        ({"extras_digest": DIGEST.upper()}, ValueError,
         "route_plan.spans[1].extras_digest must be a lowercase SHA-256 hex digest"),
        ({"extras_digest": DIGEST[:-1]}, ValueError,
         "route_plan.spans[1].extras_digest must be a lowercase SHA-256 hex digest"),
        ({"repair_previous_token": 1}, TypeError, "route_plan.spans[1].repair_previous_token must be bool"),
        ({"boundary_token_index": True}, TypeError, "route_plan.spans[1].boundary_token_index must be int, got bool"),
        ({"boundary_token_index": -1}, ValueError,
         "route_plan.spans[1].boundary_token_index must be non-negative, got -1"),
        ({"boundary_token_index": 4}, ValueError, "route_plan.spans[1] has an invalid boundary token index"),
        ({"boundary_token_index": 3, "staged_route_len": 0}, ValueError,
         "route_plan.spans[1] has an invalid boundary token index"),
        ({"repair_previous_token": True}, ValueError,
         "route_plan.spans[1] boundary repair requires adjacent generated spans"),
        ({"repair_previous_token": True, "boundary_token_index": 3, "generation_len": 0, "carry_len": 3},
         ValueError, "route_plan.spans[1] boundary repair requires adjacent generated spans"),
    ],
)
def test_validate_span_fields(changes, exc, message):
    spans = list(GOOD.spans)
    spans[1] = replace(spans[1], **changes)
    with raises_exact(exc, message):
        validate_route_plan(replace(GOOD, spans=tuple(spans)))


def test_repair_requires_generating_parent():
    p = plan([span("r/c1", 4, 0, 4), span("r/c2", 1, 2, 3, index=3, repair=True)])
    with raises_exact(ValueError, "route_plan.spans[1] boundary repair requires adjacent generated spans"):
        validate_route_plan(p)


def test_root_span_cannot_carry_a_boundary():
    p = plan([span("r/c1", 2, 2, 4, index=0, repair=True)])
    with raises_exact(ValueError, "route_plan.spans[0] has an invalid boundary token index"):
        validate_route_plan(p)


def test_v2_plan_rejects_boundary_index():
    with raises_exact(ValueError, "route_plan.spans[1] has an invalid boundary token index"):
        validate_route_plan(boundary_plan(schema=2))


def test_spanless_plan_may_carry_any_length():
    validate_route_plan(plan([], expected=7, cleanup=()))


def test_valid_plans_pass():
    validate_route_plan(GOOD)
    validate_route_plan(boundary_plan())


def test_lists_are_stored_as_tuples():
    p = RouteAssemblyPlan(3, PARTITION, [span("k", 0, 1, 1)], ["k"], 1)
    assert p.spans == (span("k", 0, 1, 1),) and p.cleanup_staging_keys == ("k",)
    hash(p)


# --- encode / decode ---------------------------------------------------------------------


def test_v3_round_trip_and_key_order():
    p = boundary_plan()
    encoded = encode_route_plan(p)
    assert list(encoded) == list(ROUTE_PLAN_FIELDS)
    assert all(list(s) == list(ROUTE_SPAN_FIELDS_V3) for s in encoded["spans"])
    assert encoded["spans"][1]["boundary_token_index"] == 3
    assert encoded["spans"][1]["repair_previous_token"] is True
    assert decode_route_plan(encoded) == p
    assert encode_route_plan(decode_route_plan(json.loads(json.dumps(encoded)))) == encoded


def test_v2_encodes_without_boundary_keys_and_decodes_with_defaults():
    p = plan([span("r/c1", 2, 2, 4), span("r/c2", 1, 2, 3)], schema=2)
    encoded = encode_route_plan(p)
    assert all(list(s) == list(ROUTE_SPAN_FIELDS_V2) for s in encoded["spans"])
    decoded = decode_route_plan(encoded)
    assert decoded == p
    assert all(s.boundary_token_index is None and s.repair_previous_token is False for s in decoded.spans)


def test_placeholder_plan_round_trips():
    p = placeholder_route_plan(staging_partition=PARTITION, cleanup_staging_keys=["a", "b", "a"], expected_token_length=7)
    assert p.spans == () and p.cleanup_staging_keys == ("a", "b") and p.expected_token_length == 7
    assert decode_route_plan(encode_route_plan(p)) == p
    assert placeholder_route_plan(staging_partition=PARTITION).expected_token_length == 1


def test_encode_validates_first():
    with pytest.raises(ValueError, match="spans contribute"):
        encode_route_plan(replace(GOOD, expected_token_length=3))


def _encoded(schema=3):
    return encode_route_plan(boundary_plan() if schema == 3 else replace(GOOD, schema_version=2))


def _with(obj, path, value=None, *, delete=False):
    target = obj
    for part in path[:-1]:
        target = target[part]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return obj


@pytest.mark.parametrize(
    "mutate,exc,message",
    [
        (lambda e: [e], TypeError, "route plan must be a dict, got list"),
        (lambda e: _with(e, ["extra"], 1), ValueError, "route_plan fields must be exactly"),
        (lambda e: _with(e, ["spans"], delete=True), ValueError, "route_plan fields must be exactly"),
        (lambda e: _with(e, ["schema_version"], "3"), ValueError, "unsupported route plan schema version 3"),
        (lambda e: _with(e, ["schema_version"], 3.0), ValueError, "unsupported route plan schema version 3.0"),
        (lambda e: _with(e, ["spans"], {}), TypeError, "route_plan.spans must be a list, got dict"),
        (lambda e: _with(e, ["spans"], ()), TypeError, "route_plan.spans must be a list, got tuple"),
        (lambda e: _with(e, ["cleanup_staging_keys"], "r/c1"), TypeError,
         "route_plan.cleanup_staging_keys must be a list, got str"),
        (lambda e: _with(e, ["spans", 0], "r/c1"), TypeError, "route_plan.spans[0] must be a dict, got str"),
        (lambda e: _with(e, ["spans", 0, "extra"], 0), ValueError, "route_plan.spans[0] fields must be exactly"),
        (lambda e: _with(e, ["spans", 1, "repair_previous_token"], delete=True), ValueError,
         "route_plan.spans[1] fields must be exactly"),
        (lambda e: _with(e, ["spans", 1, "repair_previous_token"], 1), TypeError,
         "route_plan.spans[1].repair_previous_token must be bool"),
        (lambda e: _with(e, ["spans", 1, "boundary_token_index"], True), TypeError,
         "route_plan.spans[1].boundary_token_index must be int, got bool"),
        (lambda e: _with(e, ["spans", 1, "boundary_token_index"], None), ValueError,
         "route_plan.spans[1] boundary repair requires adjacent generated spans"),  # not silently legacy
        (lambda e: _with(e, ["spans", 0, "carry_len"], True), TypeError, "route_plan.spans[0].carry_len must be int"),
        (lambda e: _with(e, ["spans", 0, "carry_len"], 2.0), TypeError, "route_plan.spans[0].carry_len must be int"),
        (lambda e: _with(e, ["spans", 0, "extras_digest_version"], "1"), ValueError,
         "route_plan.spans[0].extras_digest_version must be 1"),
        (lambda e: _with(e, ["staging_partition"], 5), TypeError, "route_plan.staging_partition must be a non-empty"),
        (lambda e: _with(e, ["expected_token_length"], "7"), TypeError,
         "route_plan.expected_token_length must be int, got str"),
        (lambda e: _with(e, ["cleanup_staging_keys", 0], 7), TypeError,
         "route_plan.cleanup_staging_keys[0] must be a non-empty"),
    ],
)
def test_strict_decode_rejects(mutate, exc, message):
    with pytest.raises(exc) as info:
        decode_route_plan(mutate(_encoded()))
    assert str(info.value).startswith(message)


def test_v2_span_with_boundary_keys_is_rejected():
    encoded = _encoded(schema=2)
    encoded["spans"][0].update(boundary_token_index=None, repair_previous_token=False)
    with pytest.raises(ValueError, match=r"^route_plan\.spans\[0\] fields must be exactly"):
        decode_route_plan(encoded)


def test_top_level_key_message_lists_both_sides():
    encoded = _encoded()
    encoded["bogus"] = 1
    with pytest.raises(ValueError) as info:
        decode_route_plan(encoded)
    assert str(info.value) == (
        f"route_plan fields must be exactly {sorted(ROUTE_PLAN_FIELDS)}, "
        f"got {sorted([*ROUTE_PLAN_FIELDS, 'bogus'])}"
    )


def test_json_round_trip_and_duplicate_keys():
    p = boundary_plan()
    assert loads_route_plan(dumps_route_plan(p)) == p
    text = dumps_route_plan(p).decode()
    duplicated = text[:-1] + ',"expected_token_length":7}'
    with pytest.raises(ValueError, match="repeats key 'expected_token_length'"):
        loads_route_plan(duplicated)


# --- size ------------------------------------------------------------------------------


def test_size_is_compact_json_bytes():
    p = plan([span("r/c1", 2, 2, 4)], cleanup=("r/c1",))
    literal = (
        '{"schema_version":3,"staging_partition":"staging","spans":[{"staging_key":"r/c1",'
        '"carry_len":2,"generation_len":2,"staged_route_len":4,"extras_digest_version":1,'
        f'"extras_digest":"{DIGEST}","boundary_token_index":null,"repair_previous_token":false}}],'
        '"cleanup_staging_keys":["r/c1"],"expected_token_length":4}'
    )
    assert dumps_route_plan(p) == literal.encode()
    assert encoded_route_plan_size_bytes(p) == len(literal) == 362


def test_size_uses_ascii_escapes():
    ascii_plan = placeholder_route_plan(staging_partition="p")
    accented = placeholder_route_plan(staging_partition="é")
    # "é" is written as the 6-byte escape \u00e9, not as 2 UTF-8 bytes.
    assert encoded_route_plan_size_bytes(accented) - encoded_route_plan_size_bytes(ascii_plan) == 5


# --- property: any valid plan round-trips byte-identically -------------------------------


@st.composite
def valid_plans(draw):
    schema = draw(st.sampled_from([2, 3]))
    n = draw(st.integers(0, 5))
    spans, position = [], 0
    for i in range(n):
        carry = draw(st.integers(0, 4))
        gen = draw(st.integers(1, 4))
        staged = draw(st.sampled_from([0, carry + gen, gen]))
        repair = schema == 3 and i > 0 and staged > 0 and draw(st.booleans())
        digest = draw(st.text("0123456789abcdef", min_size=64, max_size=64))
        spans.append(span(f"r/c{i}", carry, gen, staged, digest,
                          index=position - 1 if repair else None, repair=repair))
        position += carry + gen
    expected = position if spans else draw(st.integers(0, 50))
    return plan(spans, expected=expected, schema=schema)


@given(valid_plans())
def test_round_trip_property(p):
    encoded = encode_route_plan(p)
    assert decode_route_plan(encoded) == p
    assert loads_route_plan(dumps_route_plan(p)) == p
    assert encoded_route_plan_size_bytes(p) == len(json.dumps(encoded, separators=(",", ":")))
    assert validated_route_plan_size_bytes(p) == encoded_route_plan_size_bytes(p)
