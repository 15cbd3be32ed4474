"""Digest preconditions and encodings (spec 3), route envelopes and span classes (6),
and the no-witness terminal heuristic (5.2)."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage.contract import (
    EMPTY_EXTRAS_DIGEST,
    MISSING_ROUTE_SENTINEL,
    CallRecord,
    classify_route_span,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    decode_routed_experts,
    encode_routed_experts,
    hash_token_ids,
    routed_experts_token_count,
    select_terminal_call,
)

from . import reference as ref
from .strategies import F32_MAX, U64_MAX, generated_logprobs, identifiers, token_ids, weight_versions

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

GOLDEN_EXTRAS = "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3"
GOLDEN = dict(
    schema_version=2, digest_version=2, extras_digest_version=1, rollout_id="rollout-1",
    model_call_id="call-1", parent_call_id="parent-1", mode="token_in", prev_len=3, delta_len=2,
    cum_len=5, weight_version=7, token_ids_delta=[10, 11], token_mask_delta=[0.0, 1.0],
    generation_log_probs_delta=[0.0, -0.25], extras_digest=GOLDEN_EXTRAS, chain_hash="11" * 32,
    cumulative_hash="22" * 32)
GOLDEN_DIGEST = "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27"


def digest_error(**changes) -> str:
    with pytest.raises(ValueError) as info:
        compute_staging_digest(**{**GOLDEN, **changes})
    return str(info.value)


# --- call digest ----------------------------------------------------------------------------------

def test_golden_vectors_and_reference_agree():
    assert compute_extras_digest({"routed_experts": [[[1, 2]], [[3, 4]]]}) == GOLDEN_EXTRAS
    assert ref.extras_digest({"routed_experts": [[[1, 2]], [[3, 4]]]}) == GOLDEN_EXTRAS
    assert compute_staging_digest(**GOLDEN) == GOLDEN_DIGEST == ref.staging_digest(**GOLDEN)
    assert compute_extras_digest(None) == EMPTY_EXTRAS_DIGEST
    assert compute_extras_digest({}) == \
        "1fd859b283c766e508af525e02edd53f1861163b644f36caccdb8b2316f52e77"
    assert hash_token_ids([1, 2, 3]).startswith("4684ad7a") and hash_token_ids([1, 2, 3]).endswith(
        "a9e32e")
    assert compute_chain_hash(None, [1, 2, 3]) == \
        "48e57a14b92bae4715336b34ecfc6570ae173a5248b845655d1446592c7c26c6"


U64_OVER = 2**64
# Spec 3.5: the precondition list, in order, then the lazy encoding errors in payload order.
PRECONDITIONS = [
    ("schema", dict(schema_version=3), "unsupported staging schema version 3"),
    ("schema_bool", dict(schema_version=True), "unsupported staging schema version True"),
    ("digest", dict(digest_version=1), "unsupported staging digest version 1"),
    ("extras_version", dict(extras_digest_version=2), "unsupported extras digest version 2"),
    ("empty_rollout", dict(rollout_id=""), "rollout_id and model_call_id must be non-empty"),
    ("empty_call", dict(model_call_id=""), "rollout_id and model_call_id must be non-empty"),
    ("empty_parent", dict(parent_call_id=""), "parent_call_id must be non-empty when present"),
    ("mode", dict(mode="chat"), "unsupported capture mode 'chat'"),
    ("root_prev_len", dict(parent_call_id=None, mode="text"),
     "a parentless call must be a text-mode root with prev_len == 0"),
    ("root_mode", dict(parent_call_id=None, prev_len=0, cum_len=2),
     "a parentless call must be a text-mode root with prev_len == 0"),
    ("child_prev_len", dict(prev_len=0, cum_len=2),
     "a child call must use token_in mode with prev_len > 0"),
    ("child_mode", dict(mode="text"), "a child call must use token_in mode with prev_len > 0"),
    ("empty_delta", dict(delta_len=0), "a staged call delta must contain at least one token"),
    ("delta_len", dict(delta_len=3), "delta_len 3 does not match 2 token IDs"),
    ("equal_lengths", dict(token_mask_delta=[0.0]),
     "token IDs, masks, and log probabilities must have equal lengths"),
    ("equal_lengths_lp", dict(generation_log_probs_delta=[0.0, -0.25, -1.0]),
     "token IDs, masks, and log probabilities must have equal lengths"),
    ("mask", dict(token_mask_delta=[0.0, 0.5]), "token_mask_delta must contain only 0.0 or 1.0"),
    ("carry", dict(generation_log_probs_delta=[-0.5, -0.25]),
     "prompt-carry log probabilities must be 0.0"),
    ("cum_len", dict(prev_len=1, cum_len=7, ), "cum_len 7 does not equal prev_len + delta_len (3)"),
    ("extras_digest", dict(extras_digest=GOLDEN_EXTRAS.upper()),
     "extras_digest must be a lowercase SHA-256 hex digest"),
    ("extras_digest_short", dict(extras_digest="ab"), "extras_digest must be a lowercase SHA-256 hex digest"),
    # lazy payload errors
    ("prev_len_u64", dict(prev_len=U64_OVER, cum_len=U64_OVER + 2),
     "prev_len must be an unsigned 64-bit integer, got 18446744073709551616"),
    ("prev_len_bool", dict(prev_len=True, cum_len=3),
     "prev_len must be an unsigned 64-bit integer, got True"),
    ("weight_version_u64", dict(weight_version=U64_OVER),
     "weight_version must be an unsigned 64-bit integer, got 18446744073709551616"),
    ("weight_version_negative", dict(weight_version=-1),
     "weight_version must be an unsigned 64-bit integer, got -1"),
    ("weight_version_float", dict(weight_version=7.0),
     "weight_version must be an unsigned 64-bit integer, got 7.0"),
    ("token_u64", dict(token_ids_delta=[10, U64_OVER]),
     "token_id must be an unsigned 64-bit integer, got 18446744073709551616"),
    ("token_negative", dict(token_ids_delta=[-1, 11]),
     "token_id must be an unsigned 64-bit integer, got -1"),
    ("token_bool", dict(token_ids_delta=[True, 11]),
     "token_id must be an unsigned 64-bit integer, got True"),
    ("mask_int", dict(token_mask_delta=[0, 1]),
     "token_mask_delta values must be finite Python floats, got 0"),
    ("logprob_int", dict(generation_log_probs_delta=[0.0, -1]),
     "generation_log_probs_delta values must be finite Python floats, got -1"),
    ("logprob_nan", dict(generation_log_probs_delta=[0.0, math.nan]),
     "generation_log_probs_delta values must be finite Python floats, got nan"),
    ("logprob_inf", dict(generation_log_probs_delta=[0.0, -math.inf]),
     "generation_log_probs_delta values must be finite Python floats, got -inf"),
    ("float32_overflow", dict(generation_log_probs_delta=[0.0, -1e39]),
     "generation_log_probs_delta value cannot be represented as float32: -1e+39"),
    ("float32_midpoint", dict(generation_log_probs_delta=[0.0, -(2.0**128 - 2.0**103)]),
     "generation_log_probs_delta value cannot be represented as float32: -3.4028235677973366e+38"),
    ("chain_hash", dict(chain_hash="11" * 31), "chain_hash must be a lowercase SHA-256 hex digest"),
    ("cumulative_hash", dict(cumulative_hash=None),
     "cumulative_hash must be a lowercase SHA-256 hex digest"),
    # order: in each row the earlier check wins
    ("order_versions", dict(schema_version=1, digest_version=1), "unsupported staging schema version 1"),
    ("order_ids_mode", dict(model_call_id="", mode="x"), "rollout_id and model_call_id must be non-empty"),
    ("order_mode_lineage", dict(mode="x", prev_len=0), "unsupported capture mode 'x'"),
    ("order_lineage_delta", dict(prev_len=0, delta_len=0), "a child call must use token_in mode with prev_len > 0"),
    ("order_delta_count", dict(delta_len=3, token_mask_delta=[0.0]), "delta_len 3 does not match 2 token IDs"),
    ("order_lengths_mask", dict(token_mask_delta=[0.5]),
     "token IDs, masks, and log probabilities must have equal lengths"),
    ("order_mask_carry", dict(token_mask_delta=[0.5, 1.0], generation_log_probs_delta=[-1.0, 0.0]),
     "token_mask_delta must contain only 0.0 or 1.0"),
    ("order_carry_cum", dict(generation_log_probs_delta=[-1.0, 0.0], cum_len=9),
     "prompt-carry log probabilities must be 0.0"),
    ("order_cum_extras", dict(cum_len=9, extras_digest="x"), "cum_len 9 does not equal prev_len + delta_len (5)"),
    ("order_extras_token", dict(extras_digest="x", token_ids_delta=[U64_OVER, 1]),
     "extras_digest must be a lowercase SHA-256 hex digest"),
    ("order_uint_token", dict(weight_version=-1, token_ids_delta=[U64_OVER, 1]),
     "weight_version must be an unsigned 64-bit integer, got -1"),
    ("order_token_mask", dict(token_ids_delta=[U64_OVER, 1], token_mask_delta=[0, 1]),
     "token_id must be an unsigned 64-bit integer, got 18446744073709551616"),
    ("order_mask_logprob", dict(token_mask_delta=[0, 1], generation_log_probs_delta=[0.0, -1e39]),
     "token_mask_delta values must be finite Python floats, got 0"),
    ("order_logprob_extras32", dict(generation_log_probs_delta=[0.0, -1e39], chain_hash="x"),
     "generation_log_probs_delta value cannot be represented as float32: -1e+39"),
    ("order_chain_cumulative", dict(chain_hash="x", cumulative_hash="y"),
     "chain_hash must be a lowercase SHA-256 hex digest"),
]


@pytest.mark.parametrize("changes,message", [(c, m) for _n, c, m in PRECONDITIONS],
                         ids=[n for n, _c, _m in PRECONDITIONS])
def test_staging_digest_errors(changes, message):
    assert digest_error(**changes) == message


def test_staging_digest_text_type_error_is_a_type_error():
    with pytest.raises(TypeError, match="^expected text, got int$"):
        compute_staging_digest(**{**GOLDEN, "rollout_id": 5})
    with pytest.raises(TypeError, match="^expected text, got bytes$"):
        compute_staging_digest(**{**GOLDEN, "parent_call_id": b"p"})


@pytest.mark.parametrize("changes,error,message", [
    (dict(model_call_id=7, weight_version=-1), TypeError, "expected text, got int"),
    (dict(rollout_id="\ud800", weight_version=2**64), UnicodeEncodeError, None),
])
def test_staging_digest_text_errors_precede_length_errors(changes, error, message):
    with pytest.raises(error) as info:
        compute_staging_digest(**{**GOLDEN, **changes})
    if message is not None:
        assert str(info.value) == message


def test_lone_surrogate_is_a_value_error():
    with pytest.raises(ValueError):  # UnicodeEncodeError
        compute_staging_digest(**{**GOLDEN, "model_call_id": "\ud800"})


def test_float32_boundaries():
    below_midpoint = float(np.nextafter(2.0**128 - 2.0**103, 0.0))
    for ok in (-F32_MAX, -below_midpoint, -3.4e38, -1e-50, -5e-324, -0.0):
        fields = {**GOLDEN, "generation_log_probs_delta": [0.0, ok]}
        assert compute_staging_digest(**fields) == ref.staging_digest(**fields)
    # doubles that share a float32 image share the digest; the sign of zero does not
    same = {**GOLDEN, "generation_log_probs_delta": [0.0, -0.25 - 2.0**-40]}
    assert compute_staging_digest(**same) == GOLDEN_DIGEST
    tiny = {**GOLDEN, "generation_log_probs_delta": [0.0, -1e-50]}
    negative_zero = {**GOLDEN, "generation_log_probs_delta": [0.0, -0.0]}
    zero = {**GOLDEN, "generation_log_probs_delta": [0.0, 0.0]}
    assert compute_staging_digest(**tiny) == compute_staging_digest(**negative_zero)
    assert compute_staging_digest(**negative_zero) != compute_staging_digest(**zero)
    mask_negative_zero = {**GOLDEN, "token_mask_delta": [-0.0, 1.0]}
    assert compute_staging_digest(**mask_negative_zero) != GOLDEN_DIGEST
    assert compute_staging_digest(**mask_negative_zero) == ref.staging_digest(**mask_negative_zero)


def test_u64_bounds_are_inclusive():
    fields = {**GOLDEN, "token_ids_delta": [0, U64_MAX], "weight_version": U64_MAX}
    assert compute_staging_digest(**fields) == ref.staging_digest(**fields)
    child = {**GOLDEN, "prev_len": U64_MAX - 2, "cum_len": U64_MAX}
    assert compute_staging_digest(**child) == ref.staging_digest(**child)


@st.composite
def digest_inputs(draw):
    n = draw(st.integers(1, 12))
    carry = draw(st.integers(0, n))
    parent = draw(st.one_of(st.none(), identifiers))
    prev_len = 0 if parent is None else draw(st.integers(1, U64_MAX - n))
    return dict(
        schema_version=2, digest_version=2, extras_digest_version=1,
        rollout_id=draw(identifiers), model_call_id=draw(identifiers), parent_call_id=parent,
        mode="text" if parent is None else "token_in", prev_len=prev_len, delta_len=n,
        cum_len=prev_len + n, weight_version=draw(weight_versions),
        token_ids_delta=draw(st.lists(token_ids, min_size=n, max_size=n)),
        token_mask_delta=[0.0] * carry + [1.0] * (n - carry),
        generation_log_probs_delta=[0.0] * carry + draw(
            st.lists(generated_logprobs, min_size=n - carry, max_size=n - carry)),
        extras_digest=draw(st.sampled_from([EMPTY_EXTRAS_DIGEST, GOLDEN_EXTRAS])),
        chain_hash=draw(st.sampled_from(["11" * 32, GOLDEN_EXTRAS])),
        cumulative_hash=draw(st.sampled_from(["22" * 32, EMPTY_EXTRAS_DIGEST])))


@PROPS
@given(digest_inputs())
def test_staging_digest_matches_reference_and_numpy_inputs(fields):
    expected = ref.staging_digest(**fields)
    assert compute_staging_digest(**fields) == expected
    arrays = {**fields,
              "token_ids_delta": np.array(fields["token_ids_delta"], dtype=np.uint64),
              "token_mask_delta": np.array(fields["token_mask_delta"], dtype=np.float64),
              "generation_log_probs_delta": np.array(fields["generation_log_probs_delta"])}
    assert compute_staging_digest(**arrays) == expected
    if max(fields["token_ids_delta"]) < 2**63:
        signed = {**arrays, "token_ids_delta": arrays["token_ids_delta"].astype(np.int64)}
        assert compute_staging_digest(**signed) == expected


@PROPS
@given(st.lists(token_ids, max_size=30), st.one_of(st.none(), st.sampled_from(["11" * 32, "ab" * 32])))
def test_prefix_and_chain_hash_match_reference(ids, parent):
    assert hash_token_ids(ids) == ref.hash_token_ids(ids)
    assert hash_token_ids(np.array(ids, dtype=np.uint64)) == ref.hash_token_ids(ids)
    assert compute_chain_hash(parent, ids) == ref.chain_hash(parent, ids)
    assert compute_chain_hash(parent, np.array(ids, dtype=np.uint64)) == ref.chain_hash(parent, ids)


def test_hash_errors():
    with pytest.raises(ValueError, match="^token_id must be an unsigned 64-bit integer, got -1$"):
        hash_token_ids([1, -1])
    with pytest.raises(ValueError, match="^token_id must be an unsigned 64-bit integer, got 1.0$"):
        compute_chain_hash(None, [1.0])
    with pytest.raises(ValueError, match="^parent_chain_hash must be a lowercase SHA-256 hex digest$"):
        compute_chain_hash("AB" * 32, [1])
    with pytest.raises(ValueError, match="^token_id must be an unsigned 64-bit integer, got -1$"):
        hash_token_ids(np.array([1, -1], dtype=np.int64))
    assert compute_chain_hash(None, []) == ref.chain_hash(None, [])  # accepted by the function


# --- extras digest ------------------------------------------------------------------------------------

@pytest.mark.parametrize("a,b", [
    (None, {}), ({"x": 1}, {"x": 1.0}), ({"x": True}, {"x": 1}), ({"x": 0.0}, {"x": -0.0}),
    ({"x": "1"}, {"x": 1}), ({"x": []}, {"x": {}}), ({"x": None}, {}),
    ({"routed_experts": "nrlre1:int16:2x1x2:AQACAAMABAA="},
     {"routed_experts": "nrlre1:int8:2x1x2:AQIDBA=="}),
])
def test_extras_digest_distinguishes_types(a, b):
    assert compute_extras_digest(a) != compute_extras_digest(b)
    assert compute_extras_digest(a) == ref.extras_digest(a)
    assert compute_extras_digest(b) == ref.extras_digest(b)


def test_extras_digest_key_order_is_utf8_bytes():
    # by UTF-8 bytes "\uff01" (ef bc 81) sorts before an astral char (f0 9f ...), although
    # in UTF-16 code units the astral surrogate (d83d) sorts first
    payload = {"\U0001f600": 1, "\uff01": 2, "b": 3, "": 4, "a": 5}
    assert compute_extras_digest(payload) == ref.extras_digest(payload)
    assert compute_extras_digest(dict(reversed(list(payload.items())))) == ref.extras_digest(payload)


@pytest.mark.parametrize("value,error,message", [
    ({"x": math.nan}, ValueError, "extras floats must be finite, got nan"),
    ({"x": math.inf}, ValueError, "extras floats must be finite, got inf"),
    ({"x": 2**63}, ValueError, "extras integer is outside signed 64-bit range: 9223372036854775808"),
    ({"x": (1,)}, TypeError, "extras contain unsupported value type tuple"),
    ({"x": {1}}, TypeError, "extras contain unsupported value type set"),
    ({"x": b""}, TypeError, "extras contain unsupported value type bytes"),
    ({"x": np.int64(1)}, TypeError, "extras contain unsupported value type int64"),
    ({"x": {2: 1}}, TypeError, "extras mappings must have string keys"),
    ({1: 1}, TypeError, "extras mappings must have string keys"),
    ([1], TypeError, "extras must be a mapping or None, got list"),
    ("x", TypeError, "extras must be a mapping or None, got str"),
])
def test_extras_digest_errors(value, error, message):
    with pytest.raises(error) as info:
        compute_extras_digest(value)
    assert str(info.value) == message
    assert type(info.value) is error


def test_extras_integer_bounds_are_inclusive():
    for v in (-(2**63), 2**63 - 1):
        assert compute_extras_digest({"x": v}) == ref.extras_digest({"x": v})
    with pytest.raises(ValueError, match=r"^extras integer is outside signed 64-bit range: -9223372036854775809$"):
        compute_extras_digest({"x": -(2**63) - 1})


def test_extras_digest_has_no_depth_limit_below_the_recursion_limit():
    nested: list = []
    for _ in range(300):
        nested = [nested]
    assert compute_extras_digest({"x": nested}) == ref.extras_digest({"x": nested})


# --- route envelopes (6.2) ----------------------------------------------------------------------------

def test_envelope_example():
    assert encode_routed_experts([[[1, 2]], [[3, 4]]], dtype="int16") == \
        "nrlre1:int16:2x1x2:AQACAAMABAA="
    assert encode_routed_experts([[[1, 2]], [[3, 4]]]) == "nrlre1:int16:2x1x2:AQACAAMABAA="
    fragment = decode_routed_experts("nrlre1:int16:2x1x2:AQACAAMABAA=")
    assert fragment.values.tolist() == [[[1, 2]], [[3, 4]]]
    assert (fragment.dtype, fragment.num_layers, fragment.topk, fragment.num_tokens) == \
        ("int16", 1, 2, 2)


@PROPS
@given(st.sampled_from([("int8", 1, "<i1"), ("int16", 2, "<i2"), ("int32", 4, "<i4")]),
       st.integers(1, 5), st.integers(1, 3), st.integers(1, 3), st.data())
def test_envelope_round_trip_matches_the_byte_layout(kind, t, l, k, data):
    dtype, width, np_dtype = kind
    info = np.iinfo(np_dtype)
    values = data.draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=t * l * k,
                                max_size=t * l * k))
    nested = np.array(values, dtype=np.int64).reshape(t, l, k).tolist()
    envelope = encode_routed_experts(nested, dtype=dtype)
    raw = b"".join(v.to_bytes(width, "little", signed=True) for v in values)
    assert envelope == f"nrlre1:{dtype}:{t}x{l}x{k}:{base64.b64encode(raw).decode()}"
    assert encode_routed_experts(np.array(nested), dtype=dtype) == envelope
    fragment = decode_routed_experts(envelope)
    assert fragment.values.tolist() == nested
    assert routed_experts_token_count(envelope) == t


@pytest.mark.parametrize("payload,message", [
    ("nrlre2:int16:2x1x2:AQACAAMABAA=", "unsupported routed_experts envelope; expected nrlre1"),
    ("nrlre1:int16:2x1x2", "unsupported routed_experts envelope; expected nrlre1"),
    ("", "unsupported routed_experts envelope; expected nrlre1"),
    ("nrlre1:int64:2x1x2:AQACAAMABAA=", "unsupported routed_experts dtype 'int64'"),
    ("nrlre1::2x1x2:AQACAAMABAA=", "unsupported routed_experts dtype ''"),
    ("nrlre1:int16:2x2:AQACAAMABAA=", "routed_experts envelope shape must have three dimensions"),
    ("nrlre1:int16:2x1x2x1:AQACAAMABAA=", "routed_experts envelope shape must have three dimensions"),
    ("nrlre1:int16:2xax2:AQACAAMABAA=", "routed_experts envelope shape must contain integers"),
    ("nrlre1:int16:2x1.0x2:AQACAAMABAA=", "routed_experts envelope shape must contain integers"),
    ("nrlre1:int16:0x1x2:", "routed_experts envelope dimensions must be positive"),
    ("nrlre1:int16:2x-1x2:AQACAAMABAA=", "routed_experts envelope dimensions must be positive"),
    ("nrlre1:int16:2x1x2:AQACAAMABAA", "routed_experts envelope contains invalid base64"),
    ("nrlre1:int16:2x1x2:AQAC AAMABAA=", "routed_experts envelope contains invalid base64"),
    ("nrlre1:int16:2x1x2:AQAC\nAAMABAA=", "routed_experts envelope contains invalid base64"),
    ("nrlre1:int16:2x1x2:AQACAAMABA==", "routed_experts byte length does not match its declared shape (7 != 8)"),
    ("nrlre1:int16:2x1x2:AQACAAMABAAF", "routed_experts byte length does not match its declared shape (9 != 8)"),
    ("nrlre1:int32:2x1x2:AQACAAMABAA=", "routed_experts byte length does not match its declared shape (8 != 16)"),
])
def test_envelope_decode_errors(payload, message):
    with pytest.raises(ValueError) as info:
        decode_routed_experts(payload)
    assert str(info.value) == message


def test_envelope_shape_uses_python_int_semantics():
    # Python int() accepts surrounding spaces, '+' and '_'
    for header in ("+2x1x2", " 2x1 x2", "2x0_1x2"):
        assert decode_routed_experts(f"nrlre1:int16:{header}:AQACAAMABAA=").values.shape == (2, 1, 2)


@pytest.mark.parametrize("payload,message", [
    ("nrlre1:int8:1x1x1:AAAAAAAAAA==",
     "routed_experts byte length does not match its declared shape (7 != 1)"),
    ("nrlre1:int8:1x1x1:!!!!!!!!!!!!", "routed_experts envelope contains invalid base64"),
])
def test_envelope_long_body_messages(payload, message):
    with pytest.raises(ValueError) as info:
        decode_routed_experts(payload)
    assert str(info.value) == message


@pytest.mark.parametrize("payload,tokens", [
    ("nrlre1:int8:" + "0" * 40 + "1x1x1:AA==", 1),    # int("000...01") == 1
    ("nrlre1:int8:100000x100000x1:", 100000),          # header only: the body is not read
])
def test_envelope_header_has_no_extra_caps(payload, tokens):
    assert routed_experts_token_count(payload) == tokens


LEGACY_ERRORS = [
    ((1, 2), "legacy routed_experts must be a nested list"),
    ({"a": 1}, "legacy routed_experts must be a nested list"),
    (None, "legacy routed_experts must be a nested list"),
    ([], "routed_experts must contain at least one token row"),
    ([[]], "each routed_experts token row must contain layers"),
    ([1], "each routed_experts token row must contain layers"),
    ([([1],)], "each routed_experts token row must contain layers"),
    ([[[1]], [[1]], [[1], [2]]], "routed_experts layer count must be constant"),
    ([[[]]], "each routed_experts layer row must contain experts"),
    ([[(1, 2)]], "each routed_experts layer row must contain experts"),
    ([[[1, 2]], [[3]]], "routed_experts top-k width must be constant"),
    ([[[1, True]]], "routed_experts values must be exact integers"),
    ([[[1, 2.0]]], "routed_experts values must be exact integers"),
    ([[[1, "2"]]], "routed_experts values must be exact integers"),
]


@pytest.mark.parametrize("payload,message", LEGACY_ERRORS, ids=[m[:40] + repr(p)[:16] for p, m in LEGACY_ERRORS])
def test_legacy_nested_list_errors(payload, message):
    with pytest.raises(ValueError) as info:
        decode_routed_experts(payload)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        encode_routed_experts(payload)
    assert str(info.value) == message


def test_legacy_nested_list_decodes():
    fragment = decode_routed_experts([[[1, 2]], [[3, -1]]])
    assert fragment.dtype == "legacy-int"
    assert fragment.values.tolist() == [[[1, 2]], [[3, -1]]]
    assert (fragment.num_layers, fragment.topk, fragment.num_tokens) == (1, 2, 2)


@pytest.mark.parametrize("values,dtype", [
    ([[[128]]], "int8"), ([[[-129]]], "int8"), ([[[2**15]]], "int16"), ([[[-(2**15) - 1]]], "int16"),
    ([[[2**31]]], "int32"), ([[[-(2**31) - 1]]], "int32"), ([[[1, 2**40]]], "int32"),
])
def test_encoder_dtype_overflow(values, dtype):
    with pytest.raises(ValueError) as info:
        encode_routed_experts(values, dtype=dtype)
    assert str(info.value) == f"routed_experts values do not fit dtype '{dtype}'"


@pytest.mark.parametrize("dtype,lo,hi", [("int8", -128, 127), ("int16", -(2**15), 2**15 - 1),
                                         ("int32", -(2**31), 2**31 - 1)])
def test_encoder_dtype_bounds_are_inclusive(dtype, lo, hi):
    envelope = encode_routed_experts([[[lo, hi, MISSING_ROUTE_SENTINEL]]], dtype=dtype)
    assert decode_routed_experts(envelope).values.tolist() == [[[lo, hi, -1]]]


@pytest.mark.parametrize("dtype", ["int64", "uint8", "", None, "INT16"])
def test_encoder_unknown_dtype(dtype):
    with pytest.raises(ValueError) as info:
        encode_routed_experts([[[1]]], dtype=dtype)
    assert str(info.value) == f"unsupported routed_experts dtype {dtype!r}"


def test_routed_experts_token_count():
    assert routed_experts_token_count("nrlre1:int16:7x1x2:not base64 at all") == 7
    assert routed_experts_token_count([[[1]], [[2]], [[3]]]) == 3
    for bad in ((1,), None, 5, {"a": 1}):
        with pytest.raises(ValueError) as info:
            routed_experts_token_count(bad)
        assert str(info.value) == "legacy routed_experts must be a non-empty nested list"
    with pytest.raises(ValueError, match="expected nrlre1"):
        routed_experts_token_count("nrlre9:int16:7x1x2:")


# --- classify_route_span (6.3) -------------------------------------------------------------------

@pytest.mark.parametrize("carry,gen,staged,expected", [
    (3, 2, 5, "full"), (0, 2, 2, "full"), (3, 0, 3, "full"), (0, 1, 1, "full"),
    (3, 2, 2, "tail"), (3, 2, 4, "tail"), (3, 2, 8, "tail"), (0, 2, 9, "tail"), (3, 1, 1, "tail"),
    (3, 2, 0, "sentinel"), (3, 2, 1, "sentinel"), (3, 0, 2, "sentinel"), (0, 0, 0, "sentinel"),
    (3, 0, 0, "sentinel"), (0, 0, 5, "sentinel"),
])
def test_classify_route_span_table(carry, gen, staged, expected):
    assert classify_route_span(carry_len=carry, generation_len=gen, staged_route_len=staged) == expected


@PROPS
@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 120))
def test_classify_route_span_rule(carry, gen, staged):
    if staged > 0 and staged == carry + gen:
        expected = "full"
    elif staged > 0 and 0 < gen <= staged:
        expected = "tail"
    else:
        expected = "sentinel"
    assert classify_route_span(carry_len=carry, generation_len=gen, staged_route_len=staged) == expected


@pytest.mark.parametrize("kwargs,message", [
    (dict(carry_len=-1, generation_len=1, staged_route_len=1), "carry_len must be a non-negative integer, got -1"),
    (dict(carry_len=True, generation_len=1, staged_route_len=1), "carry_len must be a non-negative integer, got True"),
    (dict(carry_len=1.0, generation_len=1, staged_route_len=1), "carry_len must be a non-negative integer, got 1.0"),
    (dict(carry_len=0, generation_len=None, staged_route_len=1), "generation_len must be a non-negative integer, got None"),
    (dict(carry_len=0, generation_len=1, staged_route_len="3"), "staged_route_len must be a non-negative integer, got '3'"),
    (dict(carry_len=-1, generation_len=-1, staged_route_len=-1), "carry_len must be a non-negative integer, got -1"),
    (dict(carry_len=0, generation_len=-2, staged_route_len=-1), "generation_len must be a non-negative integer, got -2"),
    (dict(carry_len=0, generation_len=1, staged_route_len=np.int64(3)),
     "staged_route_len must be a non-negative integer, got np.int64(3)"),
])
def test_classify_route_span_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        classify_route_span(**kwargs)
    assert str(info.value) == message


# --- select_terminal_call (5.2) ------------------------------------------------------------------

def row(call_id, parent=None, admitted_at=None) -> CallRecord:
    prev = 0 if parent is None else 1
    return CallRecord(model_call_id=call_id, parent_call_id=parent, prev_len=prev, delta_len=1,
                      cum_len=prev + 1, weight_version=0, digest="ab" * 32,
                      extras_digest=EMPTY_EXTRAS_DIGEST, staging_key=f"R/{call_id}",
                      mode="text" if parent is None else "token_in", chain_hash="cd" * 32,
                      cumulative_hash="ef" * 32, response_id=f"resp-{call_id}",
                      admitted_at=admitted_at)


def pick(*rows):
    selection = select_terminal_call(list(rows))
    return selection.terminal_model_call_id, selection.reason


def test_select_terminal_failures():
    assert pick() == (None, "no_records")
    assert select_terminal_call(iter([])).reason == "no_records"
    assert pick(row("a"), row("b", "a"), row("b", "a")) == (None, "duplicate_call_id")
    assert pick(row("a"), row("b", "zz")) == (None, "orphaned_row")
    assert pick(row("x", "y"), row("y", "x")) == (None, "no_root")
    # a duplicate is reported before an orphan
    assert pick(row("b", "zz"), row("a"), row("a")) == (None, "duplicate_call_id")


def test_select_terminal_ambiguity():
    # two siblings with descendants
    assert pick(row("r"), row("a", "r"), row("b", "r"), row("a1", "a"), row("b1", "b")) == \
        (None, "ambiguous_terminal")
    # two childless siblings when no sibling has descendants
    assert pick(row("r"), row("a", "r"), row("b", "r")) == (None, "ambiguous_terminal")
    # ambiguity deeper down the chain
    assert pick(row("r"), row("a", "r"), row("x", "a"), row("y", "a")) == (None, "ambiguous_terminal")


def test_select_terminal_follows_descendants():
    assert pick(row("a")) == ("a", "selected")
    assert pick(row("a"), row("b", "a"), row("c", "b")) == ("c", "selected")
    # an abandoned leaf is ignored when its sibling has descendants (either manifest order)
    assert pick(row("r"), row("retry", "r"), row("b", "r"), row("c", "b")) == ("c", "selected")
    assert pick(row("c", "b"), row("b", "r"), row("retry", "r"), row("r")) == ("c", "selected")
    # ...at every level
    assert pick(row("r"), row("a", "r"), row("x", "r"), row("b", "a"), row("y", "a"),
                row("c", "b")) == ("c", "selected")


def test_select_terminal_root_choice():
    # roots with descendants are preferred over earlier childless roots
    assert pick(row("r1", admitted_at=1.0), row("r2", admitted_at=5.0), row("c", "r2")) == \
        ("c", "selected")
    # among roots with descendants: the earliest admitted_at
    assert pick(row("r1", admitted_at=5.0), row("c1", "r1"), row("r2", admitted_at=1.0),
                row("c2", "r2")) == ("c2", "selected")
    # among childless roots: earliest admitted_at, never ambiguous
    assert pick(row("r1", admitted_at=5.0), row("r2", admitted_at=1.0)) == ("r2", "selected")
    assert pick(row("r1", admitted_at=0.0), row("r2", admitted_at=1.0)) == ("r1", "selected")
    # unstamped roots sort last
    assert pick(row("r1"), row("r2", admitted_at=9.0)) == ("r2", "selected")
    # ties (and all unstamped) break by manifest position
    assert pick(row("r1"), row("r2")) == ("r1", "selected")
    assert pick(row("r2", admitted_at=3.0), row("r1", admitted_at=3.0)) == ("r2", "selected")


@PROPS
@given(st.integers(1, 6), st.integers(0, 4), st.randoms(use_true_random=False))
def test_select_terminal_on_a_chain_with_retries(depth, leaves, rnd):
    # a chain c0 -> c1 -> ... plus childless retries hanging off chain calls. A retry is
    # ignored when its sibling has descendants; a retry beside the (childless) terminal makes
    # two childless siblings: ambiguous.
    rows = [row("c0", admitted_at=rnd.uniform(0, 10))]
    for i in range(1, depth):
        rows.append(row(f"c{i}", f"c{i - 1}"))
    parents = [rnd.randrange(depth - 1) for _ in range(leaves if depth > 1 else 0)]
    rows += [row(f"retry{j}", f"c{p}") for j, p in enumerate(parents)]
    rnd.shuffle(rows)
    if depth - 2 in parents:
        assert pick(*rows) == (None, "ambiguous_terminal")
    else:
        assert pick(*rows) == (f"c{depth - 1}", "selected")
