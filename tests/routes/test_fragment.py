"""verify_route_fragment_integrity: digest rebuilt from the staged tensor (spec §3.8)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from stage.contract import EMPTY_EXTRAS_DIGEST, compute_extras_digest
from stage.routes import (
    ROUTE_ENCODING_LIST,
    ROUTE_ENCODING_NONE,
    RouteFragment,
    encode_extras_metadata_json,
    rebuild_route_extras,
    verify_route_fragment_integrity,
)
from tests.routes.factory import routes, span, stage_call


def check(staged, fragment=None, **span_changes):
    s = replace(span("k", 0, 4, 4, staged.digest), **span_changes)
    return verify_route_fragment_integrity(s, fragment or staged.fragment)


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32"])
def test_envelope_round_trip_each_dtype(dtype):
    staged = stage_call(routes(1, 4), dtype=dtype, metadata={"media_spans": [1, 2], "note": "ü"})
    assert check(staged)
    assert rebuild_route_extras(staged.fragment) == staged.extras


def test_list_encoding():
    staged = stage_call(routes(1, 4), encoding=ROUTE_ENCODING_LIST)
    assert check(staged)


def test_boundary_sidecar_is_bound():
    staged = stage_call(routes(2, 3), boundary=np.array([[[7, 8]]]), boundary_index=3)
    assert check(staged)


def test_golden_list_extras():
    # Gym's golden extras {"routed_experts": [[[1,2]],[[3,4]]]} staged as a LIST fragment.
    fragment = RouteFragment(torch.tensor([[[1, 2]], [[3, 4]]], dtype=torch.int16), ROUTE_ENCODING_LIST, b"null")
    golden = "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3"
    assert verify_route_fragment_integrity(span("k", 0, 2, 2, golden), fragment)


def test_metadata_json_canonical_form():
    assert encode_extras_metadata_json(None) == b"null"
    assert encode_extras_metadata_json({"routed_experts": "x"}) == b"{}"
    assert encode_extras_metadata_json({"b": 1, "a": "é", "routed_experts_boundary": "x"}) == '{"a":"é","b":1}'.encode()


def tampered(staged, **changes):
    return replace(staged.fragment, **changes)


def test_rejections():
    staged = stage_call(routes(1, 4), metadata={"a": 1})
    good = staged.fragment
    bumped = good.routes.clone()
    bumped[0, 0, 0] += 1
    cases = {
        "tampered routes": tampered(staged, routes=bumped),
        "tampered metadata": tampered(staged, extras_metadata_json=b'{"a":2}'),
        "metadata dropped": tampered(staged, extras_metadata_json=b"null"),
        "dtype widened": tampered(staged, routes=good.routes.to(torch.int32)),
        "reshaped": tampered(staged, routes=good.routes.reshape(4, 2, 1)),
        "row dropped": tampered(staged, routes=good.routes[:3]),
        "encoding none": tampered(staged, encoding=ROUTE_ENCODING_NONE),
        "encoding list": tampered(staged, encoding=ROUTE_ENCODING_LIST),
        "metadata not json": tampered(staged, extras_metadata_json=b"{"),
        "metadata not utf8": tampered(staged, extras_metadata_json=b"\xff"),
        "metadata a list": tampered(staged, extras_metadata_json=b"[]"),
        "metadata str type": tampered(staged, extras_metadata_json='{"a":1}'),
        "routes not tensor": tampered(staged, routes=good.routes.numpy()),
        "float routes": tampered(staged, routes=good.routes.float()),
        "unexpected boundary": tampered(staged, boundary_routes=torch.zeros(1, 1, 2, dtype=torch.int16)),
        "nan metadata": tampered(staged, extras_metadata_json=b'{"a":NaN}'),
    }
    assert check(staged, good)
    failed_open = [name for name, fragment in cases.items() if check(staged, fragment)]
    assert failed_open == []


def test_span_commitment_rejections():
    staged = stage_call(routes(1, 4))
    assert not check(staged, extras_digest_version=2)
    assert not check(staged, extras_digest_version=True)
    assert not check(staged, extras_digest=EMPTY_EXTRAS_DIGEST)
    assert not verify_route_fragment_integrity(object(), staged.fragment)  # never raises


def test_boundary_rejections():
    staged = stage_call(routes(2, 3), boundary=np.array([[[7, 8]]]), boundary_index=3)
    other = staged.fragment.boundary_routes.clone()
    other[0, 0, 1] = 9
    assert not check(staged, replace(staged.fragment, boundary_routes=other))
    assert not check(staged, replace(staged.fragment, boundary_routes=None))
    assert not check(staged, replace(staged.fragment, boundary_routes=other.to(torch.int32)))
    # A malformed index in metadata is malformed metadata, even if it is what was digested.
    for bad in (-1, True, 3.0):
        extras = {**staged.extras, "routed_experts_boundary_index": bad}
        fragment = replace(staged.fragment, extras_metadata_json=encode_extras_metadata_json(extras))
        assert not verify_route_fragment_integrity(span("k", 0, 3, 3, compute_extras_digest(extras)), fragment)


def test_non_contiguous_routes():
    # Non-contiguous tensors still rebuild the exact committed envelope.
    staged = stage_call(routes(1, 4, layers=2, topk=2))
    transposed = staged.fragment.routes.transpose(1, 2).contiguous().transpose(1, 2)
    assert not transposed.is_contiguous()
    assert check(staged, replace(staged.fragment, routes=transposed))
