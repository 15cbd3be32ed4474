"""execute_route_plan: full/tail/sentinel assembly, boundary repair, every failure reason."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from stage.routes import (
    ROUTE_ENCODING_LIST,
    ROUTE_FAILURE_ASSEMBLED_LENGTH,
    ROUTE_FAILURE_BOUNDARY,
    ROUTE_FAILURE_CANONICAL_LENGTH,
    ROUTE_FAILURE_INTEGRITY,
    ROUTE_FAILURE_LENGTH,
    ROUTE_FAILURE_MISSING_FRAGMENT,
    ROUTE_FAILURE_MODEL_SHAPE,
    ROUTE_FAILURE_RANK,
    RouteFragment,
    encode_extras_metadata_json,
    execute_route_plan,
    placeholder_route_plan,
)
from stage.contract import compute_extras_digest
from tests.routes.factory import K, L, PARTITION, plan, routes, span, stage_call, two_turn

DIMS = (L, K)


def run(p, fragments, dims=DIMS, canonical_len=None):
    return execute_route_plan(
        p, fragments, dims=dims, canonical_len=p.expected_token_length if canonical_len is None else canonical_len
    )


def ok(p, fragments, **kw) -> torch.Tensor:
    tensor, reason = run(p, fragments, **kw)
    assert reason is None
    return tensor


def sentinel(rows, layers=L, topk=K):
    return np.full((rows, layers, topk), -1)


def test_full_spans_concatenate_in_chain_order():
    c1, c2 = stage_call(routes(1, 4)), stage_call(routes(2, 3))
    p = plan([span("r/c1", 2, 2, 4, c1.digest), span("r/c2", 1, 2, 3, c2.digest)])
    out = ok(p, {"r/c1": c1.fragment, "r/c2": c2.fragment})
    assert out.dtype == torch.int16 and out.shape == (7, L, K)
    assert out.tolist() == np.concatenate([routes(1, 4), routes(2, 3)]).tolist()


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32"])
def test_output_is_int16_whatever_was_staged(dtype):
    big = routes(1, 4) + (1000 if dtype == "int32" else 0)
    staged = stage_call(big, dtype=dtype)
    assert staged.fragment.routes.dtype == getattr(torch, dtype)
    out = ok(plan([span("r/c1", 2, 2, 4, staged.digest)]), {"r/c1": staged.fragment})
    assert out.dtype == torch.int16
    assert out.tolist() == big.tolist()


def test_list_encoded_fragment():
    staged = stage_call(routes(1, 3), encoding=ROUTE_ENCODING_LIST)
    out = ok(plan([span("r/c1", 1, 2, 3, staged.digest)]), {"r/c1": staged.fragment})
    assert out.tolist() == routes(1, 3).tolist()


def test_tail_span_fills_generated_suffix_only():
    # Engine returned routes for prompt+generation (5 rows) but the span is carry 1 + gen 2.
    staged = stage_call(routes(1, 5))
    out = ok(plan([span("r/c1", 1, 2, 5, staged.digest)]), {"r/c1": staged.fragment})
    assert out.tolist() == np.concatenate([sentinel(1), routes(1, 5)[-2:]]).tolist()


def test_sentinel_span_needs_no_fragment():
    c1 = stage_call(routes(1, 4))
    p = plan([span("r/c1", 2, 2, 4, c1.digest), span("r/c2", 1, 2, 0)])
    out = ok(p, {"r/c1": c1.fragment})  # no entry for r/c2
    assert out.tolist() == np.concatenate([routes(1, 4), sentinel(3)]).tolist()


def test_placeholder_plan_is_all_sentinel():
    p = placeholder_route_plan(staging_partition=PARTITION, expected_token_length=3)
    assert ok(p, {}).tolist() == sentinel(3).tolist()


@pytest.mark.parametrize("dtype", ["int8", "int16"])
@pytest.mark.parametrize("parent_routes", [True, False], ids=["routed-parent", "sentinel-parent"])
def test_boundary_repair_overwrites_parents_last_token(dtype, parent_routes):
    case = two_turn(dtype, parent_routes=parent_routes)
    before = {k: f.routes.clone() for k, f in case.fragments.items()}
    out = ok(case.plan, case.fragments)
    assert torch.equal(out, case.expected)
    assert out[3].tolist() == case.boundary_route[0].tolist()
    # The parent's staged fragment (bound by its digest) is never mutated.
    assert all(torch.equal(before[k], case.fragments[k].routes) for k in before)


def test_device_auto_matches_cpu():
    case = two_turn()
    tensor, _ = execute_route_plan(case.plan, case.fragments, dims=DIMS, canonical_len=7, device="auto")
    assert torch.equal(tensor.cpu(), case.expected)


# --- failures --------------------------------------------------------------------------


def reason(p, fragments, **kw):
    tensor, why = run(p, fragments, **kw)
    assert tensor is None
    return why


def test_canonical_length_mismatch():
    case = two_turn()
    assert reason(case.plan, case.fragments, canonical_len=8) == ROUTE_FAILURE_CANONICAL_LENGTH


def test_missing_fragment():
    case = two_turn()
    del case.fragments["r/c2"]
    assert reason(case.plan, case.fragments) == ROUTE_FAILURE_MISSING_FRAGMENT


@pytest.mark.parametrize("what", ["routes", "metadata", "boundary", "digest"])
def test_fragment_integrity(what):
    case = two_turn()
    frag = case.fragments["r/c2"]
    if what == "routes":
        bumped = frag.routes.clone()
        bumped[1, 0, 0] += 1
        case.fragments["r/c2"] = replace(frag, routes=bumped)
    elif what == "metadata":
        case.fragments["r/c2"] = replace(frag, extras_metadata_json=b'{"routed_experts_boundary_index":3,"x":1}')
    elif what == "boundary":
        case.fragments["r/c2"] = replace(frag, boundary_routes=frag.boundary_routes + 1)
    else:
        spans = (case.plan.spans[0], replace(case.plan.spans[1], extras_digest="0" * 64))
        case = replace(case, plan=replace(case.plan, spans=spans))
    assert reason(case.plan, case.fragments) == ROUTE_FAILURE_INTEGRITY


def test_integrity_is_checked_before_shape():
    staged = stage_call(routes(1, 4, layers=2))
    p = plan([span("r/c1", 2, 2, 4, staged.digest)])
    assert reason(p, {"r/c1": staged.fragment}) == ROUTE_FAILURE_MODEL_SHAPE  # honest, wrong model
    bumped = staged.fragment.routes.clone()
    bumped[0, 0, 0] += 1
    assert reason(p, {"r/c1": replace(staged.fragment, routes=bumped)}) == ROUTE_FAILURE_INTEGRITY


def committed_list_fragment(values: list):
    """A producer that committed a non-[T,L,K] nested list: integrity passes, shape must not."""
    extras = {"routed_experts": values}
    fragment = RouteFragment(torch.tensor(values, dtype=torch.int16), ROUTE_ENCODING_LIST, encode_extras_metadata_json(extras))
    return fragment, compute_extras_digest(extras)


def test_fragment_rank():
    fragment, digest = committed_list_fragment([[1, 2], [3, 4]])
    assert reason(plan([span("r/c1", 0, 2, 2, digest)]), {"r/c1": fragment}) == ROUTE_FAILURE_RANK


def test_fragment_length():
    staged = stage_call(routes(1, 2))  # 2 rows staged, plan says 3
    assert reason(plan([span("r/c1", 1, 2, 3, staged.digest)]), {"r/c1": staged.fragment}) == ROUTE_FAILURE_LENGTH


def test_fragment_model_shape():
    staged = stage_call(routes(1, 4))
    p = plan([span("r/c1", 2, 2, 4, staged.digest)])
    assert reason(p, {"r/c1": staged.fragment}, dims=(2, 2)) == ROUTE_FAILURE_MODEL_SHAPE
    assert reason(p, {"r/c1": staged.fragment}, dims=(1, 3)) == ROUTE_FAILURE_MODEL_SHAPE


def test_boundary_index_in_metadata_but_not_in_plan():
    case = two_turn()
    spans = (case.plan.spans[0], replace(case.plan.spans[1], boundary_token_index=None, repair_previous_token=False))
    assert reason(replace(case.plan, spans=spans), case.fragments) == ROUTE_FAILURE_BOUNDARY


def test_boundary_index_in_plan_but_not_staged():
    case = two_turn()
    plain = stage_call(routes(2, 3))
    spans = (case.plan.spans[0], replace(case.plan.spans[1], extras_digest=plain.digest))
    p = replace(case.plan, spans=spans)
    assert reason(p, {**case.fragments, "r/c2": plain.fragment}) == ROUTE_FAILURE_BOUNDARY


def test_boundary_tensor_with_wrong_shape():
    wide = stage_call(routes(2, 3), boundary=np.array([[[7, 8]], [[9, 9]]]), boundary_index=3)
    case = two_turn()
    spans = (case.plan.spans[0], replace(case.plan.spans[1], extras_digest=wide.digest))
    assert reason(replace(case.plan, spans=spans), {**case.fragments, "r/c2": wide.fragment}) == ROUTE_FAILURE_BOUNDARY


def test_repair_without_boundary_tensor_unvalidated_plan():
    # Validation forbids this plan; the executor must still refuse rather than write garbage.
    c1, c2 = stage_call(routes(1, 4)), stage_call(routes(2, 3))
    p = plan([span("r/c1", 2, 2, 4, c1.digest), span("r/c2", 1, 2, 3, c2.digest, repair=True)])
    assert reason(p, {"r/c1": c1.fragment, "r/c2": c2.fragment}) == ROUTE_FAILURE_BOUNDARY


def test_repair_at_wrong_index_unvalidated_plan():
    c1 = stage_call(routes(1, 4))
    c2 = stage_call(routes(2, 3), boundary=np.array([[[7, 8]]]), boundary_index=2)
    p = plan([span("r/c1", 2, 2, 4, c1.digest), span("r/c2", 1, 2, 3, c2.digest, index=2, repair=True)])
    assert reason(p, {"r/c1": c1.fragment, "r/c2": c2.fragment}) == ROUTE_FAILURE_BOUNDARY


def test_assembled_length_mismatch_unvalidated_plan():
    short = plan([span("r/c1", 1, 2, 0)], expected=4)  # spans cover 3 of 4 tokens
    assert reason(short, {}) == ROUTE_FAILURE_ASSEMBLED_LENGTH
    staged = stage_call(routes(1, 5))
    long = plan([span("r/c1", 2, 3, 5, staged.digest)], expected=4)  # would write past the end
    assert reason(long, {"r/c1": staged.fragment}) == ROUTE_FAILURE_ASSEMBLED_LENGTH


def test_overrunning_unvalidated_plan_reports_the_span_checks_first():
    """Spec §3.6 per-span order: a span that would write past the row is still judged by its
    fragment checks (missing, integrity, rank, length, model shape, boundary) before the
    overrun, which is reported as the final length check would report it."""
    staged = stage_call(routes(1, 5))
    long = plan([span("r/c1", 2, 3, 5, staged.digest)], expected=4)
    assert reason(long, {}) == ROUTE_FAILURE_MISSING_FRAGMENT
    tampered = RouteFragment(staged.fragment.routes + 1, staged.fragment.encoding,
                             staged.fragment.extras_metadata_json, None)
    assert reason(long, {"r/c1": tampered}) == ROUTE_FAILURE_INTEGRITY
    assert reason(long, {"r/c1": staged.fragment}, dims=(L + 1, K)) == ROUTE_FAILURE_MODEL_SHAPE
    assert reason(long, {"r/c1": staged.fragment}) == ROUTE_FAILURE_ASSEMBLED_LENGTH
    # a sentinel span before it moves the position past the end without any fragment read
    c2 = stage_call(routes(2, 2))
    after = plan([span("r/c0", 3, 0, 0), span("r/c2", 0, 2, 2, c2.digest)], expected=4)
    assert reason(after, {}) == ROUTE_FAILURE_MISSING_FRAGMENT
    assert reason(after, {"r/c2": c2.fragment}) == ROUTE_FAILURE_ASSEMBLED_LENGTH
