"""RouteEnvelope: the nrlre1 envelope as parts. Its text is encode_routed_experts' text, and the
extras digest of extras holding envelopes (streamed) equals Gym's digest of the strings."""

import base64

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage.contract import RouteEnvelope, compute_extras_digest, encode_routed_experts
from stage.contract import routes as routes_module

DTYPES = {"int8": np.int8, "int16": np.int16, "int32": np.int32}


def _reference_envelope(values: np.ndarray, dtype: str) -> str:
    # the spec's definition, written out (section 6.2)
    t, l, k = values.shape
    raw = values.astype(np.dtype(DTYPES[dtype]).newbyteorder("<")).tobytes()
    return f"nrlre1:{dtype}:{t}x{l}x{k}:{base64.b64encode(raw).decode()}"


@st.composite
def route_arrays(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = (draw(st.integers(1, 40)), draw(st.integers(1, 5)), draw(st.integers(1, 4)))
    info = np.iinfo(DTYPES[dtype])
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = rng.integers(info.min, info.max, shape, endpoint=True)
    stored = draw(st.sampled_from(["int64", dtype, "big-endian", "strided"]))
    if stored == dtype:
        values = values.astype(DTYPES[dtype])
    elif stored == "big-endian":
        values = values.astype(np.dtype(DTYPES[dtype]).newbyteorder(">"))
    elif stored == "strided":
        values = np.repeat(values, 2, axis=2)[:, :, ::2]
    return values, dtype


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(route_arrays(), route_arrays(), st.dictionaries(st.text(max_size=12), json_values, max_size=4))
def test_streamed_digest_equals_the_digest_of_the_envelope_strings(routes, boundary, metadata):
    (values, dtype), (bvalues, bdtype) = routes, boundary
    envelope, side = RouteEnvelope.of(values, dtype), RouteEnvelope.of(bvalues, bdtype)
    assert envelope.text() == encode_routed_experts(values, dtype) == _reference_envelope(values, dtype)
    assert envelope.text_length == len(envelope.text())
    as_text = {**metadata, "routed_experts": envelope.text(), "routed_experts_boundary": side.text()}
    streamed = {**metadata, "routed_experts": envelope, "routed_experts_boundary": side}
    assert compute_extras_digest(streamed) == compute_extras_digest(as_text)


def test_envelopes_larger_than_a_chunk_and_nested_envelopes_digest_like_their_text(monkeypatch):
    monkeypatch.setattr(routes_module, "_B64_CHUNK", 3 * 7)   # many chunks, and a short last one
    values = np.arange(5 * 3 * 7, dtype=np.int16).reshape(5, 3, 7) - 40
    envelope = RouteEnvelope.of(values, "int16")
    assert len(list(envelope.text_chunks())) > 5
    assert envelope.text() == _reference_envelope(values, "int16")
    nested = {"a": [1, {"b": envelope}], "z": envelope}
    assert compute_extras_digest(nested) == compute_extras_digest(
        {"a": [1, {"b": envelope.text()}], "z": envelope.text()})


def test_golden_envelope_and_the_encoder_errors_are_unchanged():
    assert RouteEnvelope.of([[[1, 2]], [[3, 4]]], "int16").text() == "nrlre1:int16:2x1x2:AQACAAMABAA="
    with pytest.raises(ValueError, match="do not fit dtype 'int8'"):
        RouteEnvelope.of(np.full((1, 1, 1), 128), "int8")
    with pytest.raises(ValueError, match="unsupported routed_experts dtype 'int4'"):
        RouteEnvelope.of(np.ones((1, 1, 1), np.int8), "int4")
    with pytest.raises(ValueError, match="non-empty"):
        RouteEnvelope.of(np.ones((0, 1, 1), np.int8), "int8")
    # already narrower than the envelope dtype: no value scan needed, same text
    assert RouteEnvelope.of(np.full((2, 2, 2), -128, np.int8), "int16").text() == \
        _reference_envelope(np.full((2, 2, 2), -128), "int16")
