"""Direct-mode pre-checks, the group route tensor, devices and the CUDA parity script."""

from __future__ import annotations

import pytest
import torch

from stage.routes import (
    METRIC_ROUTED_EXPERTS_ROW_COVERAGE as COVERAGE,
    METRIC_ROUTED_EXPERTS_SENTINEL_TOKEN_FRACTION as SENTINEL_FRACTION,
    ROUTE_FAILURE_MISSING_FRAGMENT,
    ROUTE_FAILURE_RANK,
    UNKNOWN_ROUTE_DIMS_MESSAGE,
    RouteDimsCache,
    build_group_route_tensor,
    execute_direct_plan,
    execute_route_plan,
    resolve_device,
)
from stage.routes import cuda_check
from tests.routes.factory import K, L, plan, raises_exact, routes, span, stage_call, two_turn

# --- execute_direct_plan (spec §3.7) ------------------------------------------------------


def test_rollout_without_staged_routes_is_valid_and_routeless():
    p = plan([span("r/c1", 2, 2, 0), span("r/c2", 1, 2, 0)])
    cache = RouteDimsCache()
    assert execute_direct_plan(p, {"r/c1": None, "r/c2": None}, cache) == (None, None)
    assert cache.dims is None


def test_success_matches_shared_executor_in_the_rollouts_own_dims():
    case = two_turn()
    cache = RouteDimsCache()
    tensor, reason = execute_direct_plan(case.plan, {**case.fragments, "r/off-chain": None}, cache)
    assert reason is None and torch.equal(tensor, case.expected)
    assert cache.dims is None     # one rollout's dims are not the stage's (stage.routes.dims)
    shared, _ = execute_route_plan(case.plan, case.fragments, dims=(L, K), canonical_len=7)
    assert torch.equal(tensor, shared)


def test_dims_come_from_first_fetched_fragment_even_off_chain():
    case = two_turn()
    off_chain = stage_call(routes(9, 2, layers=3, topk=5)).fragment  # manifest order: first
    cache = RouteDimsCache()
    tensor, reason = execute_direct_plan(case.plan, {"r/off-chain": off_chain, **case.fragments}, cache)
    assert (tensor, reason) == (None, "fragment_model_shape") and cache.dims is None


def test_a_rollout_whose_dims_are_not_the_agreed_ones_is_rejected_before_execution():
    case = two_turn()
    cache = RouteDimsCache(dims=(7, 7))  # agreed by earlier rollouts
    assert execute_direct_plan(case.plan, case.fragments, cache) == (None, "fragment_model_shape")
    assert cache.dims == (7, 7)


def test_first_fragment_rank_is_checked():
    case = two_turn()
    flat = stage_call(routes(9, 2)).fragment
    flat = type(flat)(flat.routes.reshape(2, 2), flat.encoding, flat.extras_metadata_json)
    cache = RouteDimsCache()
    assert execute_direct_plan(case.plan, {"r/off-chain": flat, **case.fragments}, cache) == (None, ROUTE_FAILURE_RANK)
    assert cache.dims is None


def test_no_fragments_and_unknown_dims_is_missing_fragment():
    case = two_turn()
    assert execute_direct_plan(case.plan, {"r/c1": None}, RouteDimsCache()) == (None, ROUTE_FAILURE_MISSING_FRAGMENT)


def test_no_fragments_with_cached_dims_runs_executor():
    case = two_turn()
    cache = RouteDimsCache(dims=(L, K))
    assert execute_direct_plan(case.plan, {}, cache) == (None, ROUTE_FAILURE_MISSING_FRAGMENT)
    assert cache.dims == (L, K)


# --- build_group_route_tensor (spec §3.9) -------------------------------------------------


def row(call, n, dtype=torch.int16):
    return torch.tensor(routes(call, n), dtype=dtype)


def test_group_tensor_and_metrics():
    with_gap = row(1, 3)
    with_gap[1] = -1  # one position carries no route at all
    partial = row(2, 2)
    partial[0, 0, 0] = -1  # partially sentinel: still a routed position
    cache = RouteDimsCache()
    out, metrics = build_group_route_tensor(
        [with_gap, None, row(5, 2), partial.to(torch.int8)],
        [3, 2, 0, 2],
        cache,
        valid=[True, True, False, True],
        rollout_ids=["r0", "r1", "r2", "r3"],
    )
    assert cache.dims == (L, K)
    assert out.dtype == torch.int16 and out.shape == (4, 3, L, K)
    assert torch.equal(out[0], with_gap)
    assert (out[1] == -1).all() and (out[2] == -1).all()  # routeless valid row and placeholder
    assert torch.equal(out[3, :2], partial) and (out[3, 2] == -1).all()
    assert metrics == {COVERAGE: 2 / 3, SENTINEL_FRACTION: (1 + 2 + 0) / (3 + 2 + 2)}


def test_placeholder_routes_do_not_set_dims():
    cache = RouteDimsCache(dims=(L, K))
    out, metrics = build_group_route_tensor([row(1, 2, dtype=torch.int16)[:, :, :1], None], [2, 2], cache, valid=[False, True])
    assert out.shape == (2, 2, L, K) and cache.dims == (L, K)
    assert metrics == {COVERAGE: 0.0, SENTINEL_FRACTION: 1.0}


def test_unknown_dims_raise():
    with raises_exact(RuntimeError, UNKNOWN_ROUTE_DIMS_MESSAGE):
        build_group_route_tensor([None, None], [3, 0], RouteDimsCache(), valid=[True, False])
    assert UNKNOWN_ROUTE_DIMS_MESSAGE.startswith("policy.router_replay.enabled=true (token-capture mode)")


def test_cached_dims_shape_placeholder_only_group():
    out, metrics = build_group_route_tensor([None, None], [0, 0], RouteDimsCache(dims=(2, 3)), valid=[False, False])
    assert out.shape == (2, 1, 2, 3) and (out == -1).all()
    assert metrics == {}


def test_row_shape_mismatch_raises():
    with raises_exact(RuntimeError, "rebuilt routed_experts shape (2, 1, 2) does not match (3, 1, 2) for rollout r1"):
        build_group_route_tensor([row(1, 3), row(2, 2)], [3, 3], RouteDimsCache(), rollout_ids=["r0", "r1"])


def test_parallel_inputs_required():
    with pytest.raises(ValueError, match="parallel"):
        build_group_route_tensor([None], [1, 2], RouteDimsCache(dims=(1, 1)))


# --- devices -----------------------------------------------------------------------------


def test_resolve_device(monkeypatch):
    assert resolve_device("cpu") == resolve_device(None) == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unsupported route device"):
        resolve_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")


def test_cuda_check_script(capsys):
    assert cuda_check.check_devices("cpu", "cpu") == 7
    assert cuda_check.main([]) == 0
    out = capsys.readouterr().out
    expected = "OK:" if torch.cuda.is_available() else "SKIP: CUDA is not available"
    assert expected in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_matches_cpu():
    cuda_check.check_devices("cpu", "cuda")
