"""Learned route dims (direct router replay without configured dims): bounded, and agreed by a
majority of rollouts, so that one rollout never decides the (L, K) of others (issue 29 item 3)."""

from __future__ import annotations

import torch

from stage.routes import (
    MAX_LEARNED_ROUTE_SLOTS,
    ROUTE_FAILURE_DIMS_LIMIT,
    ROUTE_FAILURE_MODEL_SHAPE,
    ConfiguredRouteDims,
    GroupDims,
    RouteDimsCache,
    execute_direct_plan,
)
from stage.routes.dims import WINDOW
from tests.routes.factory import K, L, plan, routes, span, stage_call, two_turn

HONEST, ODD = (48, 8), (32, 16)


def fragment(rows: int, layers: int, topk: int) -> torch.Tensor:
    return torch.zeros((rows, layers, topk), dtype=torch.int8)


def test_a_fragment_over_the_learned_bound_is_rejected_before_anything_of_its_shape_is_built():
    """The issue's rollout: 4 tokens of int8 routes at L=1024, K=64 (262 kB)."""
    huge = stage_call(routes(1, 4, layers=1024, topk=64) % 100, dtype="int8")
    p = plan([span("r/c1", 0, 4, 4, huge.digest)])
    cache = RouteDimsCache()
    assert execute_direct_plan(p, {"r/c1": huge.fragment}, cache) == (None, ROUTE_FAILURE_DIMS_LIMIT)
    assert cache.dims is None
    assert 1024 * 64 > MAX_LEARNED_ROUTE_SLOTS >= 128 * 16    # well above every published MoE model


def test_one_rollout_executes_in_its_own_dims_and_does_not_set_the_stages():
    case = two_turn()
    cache = RouteDimsCache()
    tensor, reason = execute_direct_plan(case.plan, case.fragments, cache)
    assert reason is None and torch.equal(tensor, case.expected)
    assert cache.dims is None                     # one rollout: nothing agreed


def test_dims_are_agreed_by_two_rollouts_holding_a_strict_majority():
    cache = RouteDimsCache()
    assert cache.settle([ODD]) == GroupDims(ODD, agreed=False)   # its own group's, not agreed
    assert cache.dims is None
    assert cache.settle([HONEST]) == GroupDims(HONEST, agreed=False)   # 1 vote each: no majority
    assert cache.settle([HONEST, HONEST]) == GroupDims(HONEST, agreed=True)
    assert cache.dims == HONEST


def test_a_tie_inside_a_group_settles_no_dims():
    assert RouteDimsCache().settle([ODD, HONEST]) == GroupDims(None, agreed=False)


def test_agreed_dims_reject_a_rollout_with_other_dims_and_a_majority_replaces_them():
    cache = RouteDimsCache()
    cache.settle([ODD, ODD])                     # a misconfigured worker's first rollouts
    assert cache.dims == ODD
    honest = fragment(3, *HONEST)
    assert cache.rollout_dims(honest) == (None, ROUTE_FAILURE_MODEL_SHAPE)   # counted, rejected
    assert cache.rollout_dims(honest) == (None, ROUTE_FAILURE_MODEL_SHAPE)   # 2 of 4: no majority
    assert cache.rollout_dims(honest) == (HONEST, None)                      # 3 of 5: agreed now
    assert cache.dims == HONEST
    assert cache.rollout_dims(fragment(3, *ODD)) == (None, ROUTE_FAILURE_MODEL_SHAPE)


def test_votes_over_the_bound_never_count_and_the_window_is_bounded():
    cache = RouteDimsCache()
    cache.settle([(1024, 64)] * 5)
    assert cache.dims is None
    for _ in range(3):
        cache.settle([HONEST] * (WINDOW // 2))
    assert cache.dims == HONEST and len(cache._votes) == WINDOW and sum(cache._tally.values()) == WINDOW


def test_dims_given_at_construction_are_agreed():
    cache = RouteDimsCache(dims=(L, K))
    assert cache.settle([]) == GroupDims((L, K), agreed=True)


def test_configured_dims_are_never_counted_nor_bounded():
    cache = ConfiguredRouteDims((1024, 64))
    assert cache.rollout_dims(fragment(1, 2, 2)) == ((1024, 64), None)   # the executor says why
    assert cache.settle([(2, 2), (2, 2)]) == GroupDims((1024, 64), agreed=True)
    assert cache.dims == (1024, 64)
