"""Direct router replay with learned dims (``route_layers``/``route_topk`` unset, the default):
one small rollout with absurd (L, K) used to set the shape every sibling was filled with, and
the dims stayed for later groups (issue 29 item 3). Now the odd rollout is rejected with a
named reason and only dims a majority of rollouts agreed on shape another rollout's row."""

from __future__ import annotations

import torch

from stage.finalize import InMemoryTokenSource, Reassembler, ReassemblyConfig
from stage.finalize.group import DROP_NO_ROUTE_DIMS
from tests.finalize.factory import CallSpec, Group, route_extras, route_values, stage_rollout

DIRECT = ReassemblyConfig(router_replay=True)
L, K = 2, 2
SIBLING_TOKENS = 400


def _routed(source, rollout_id, tokens=4, *, layers=L, topk=K, dtype="int16"):
    half = tokens // 2
    values = route_values(1, tokens, layers=layers, topk=topk) % 100    # fits int8
    extras = route_extras(values, dtype=dtype)
    return stage_rollout(source, rollout_id, [CallSpec("c1", None, list(range(10, 10 + half)),
                                                       list(range(50, 50 + tokens - half)), extras=extras)])


def _unrouted(source, rollout_id, tokens=SIBLING_TOKENS):
    half = tokens // 2
    return stage_rollout(source, rollout_id, [CallSpec("c1", None, list(range(1, half + 1)),
                                                       list(range(1, tokens - half + 1)))])


def _route_bytes(out) -> int:
    return sum(row.routed_experts.nbytes for row in out.rows if row.routed_experts is not None)


def test_an_absurd_rollout_is_rejected_and_never_shapes_its_sibling():
    """The issue's case: 4 tokens of int8 routes at L=1024, K=64 beside a sibling that staged
    no routes (it was filled with a [length, 1024, 64] tensor of -1: 1,882x the input)."""
    source = InMemoryTokenSource()
    odd = _routed(source, "odd", layers=1024, topk=64, dtype="int8")
    sibling = _unrouted(source, "sibling")
    fin = Reassembler(source, DIRECT)
    out = Group().add("odd", odd.receipt_json()).add("sibling", sibling.receipt_json()).run(fin)
    assert out.rejections == [(0, "odd", "route_assembly:fragment_dims_limit"),
                              (1, "sibling", "route_dims_unknown")]   # as if the odd one were not there
    assert out.dropped and out.drop_reason == DROP_NO_ROUTE_DIMS and _route_bytes(out) == 0
    assert fin.dims_cache.dims is None


def test_with_agreed_dims_the_absurd_rollout_costs_nothing_and_its_sibling_is_shaped_by_them():
    source = InMemoryTokenSource()
    fin = Reassembler(source, DIRECT)
    first = Group(group_id="g1")
    for rid in ("a", "b"):
        first.add(rid, _routed(source, rid).receipt_json())
    assert first.run(fin).valid_row_count == 2 and fin.dims_cache.dims == (L, K)
    odd = _routed(source, "odd", layers=1024, topk=64, dtype="int8")
    sibling = _unrouted(source, "sibling")
    out = Group(group_id="g2").add("odd", odd.receipt_json()).add("sibling", sibling.receipt_json()).run(fin)
    assert out.rejections == [(0, "odd", "route_assembly:fragment_dims_limit")]
    assert out.rows[1].routed_experts.shape == (SIBLING_TOKENS, L, K)
    assert _route_bytes(out) == (1 + SIBLING_TOKENS) * L * K * 2 and fin.dims_cache.dims == (L, K)


def test_one_rollout_within_the_bound_shapes_only_its_own_row_and_is_not_remembered():
    """Dims no other rollout agreed with: the rollout keeps its own routes, a sibling without
    routes is not filled in them, and a later group is not shaped by them."""
    source = InMemoryTokenSource()
    fin = Reassembler(source, DIRECT)
    odd = _routed(source, "odd", layers=32, topk=16)
    sibling = _unrouted(source, "sibling")
    out = Group(group_id="g1").add("odd", odd.receipt_json()).add("sibling", sibling.receipt_json()).run(fin)
    assert out.rows[0].valid and out.rows[0].routed_experts.shape == (4, 32, 16)
    assert out.rejections == [(1, "sibling", "route_dims_unknown")]
    assert out.rows[1].routed_experts.shape == (1, 32, 16)            # a placeholder: one token
    assert fin.dims_cache.dims is None
    later = _unrouted(source, "later", tokens=40)
    out = Group(group_id="g2").add("later", later.receipt_json()).run(fin)
    assert out.dropped and out.rejections == [(0, "later", "route_dims_unknown")]
    # two honest rollouts agree; the odd dims are outvoted from then on
    honest = Group(group_id="g3")
    for rid in ("h1", "h2"):
        honest.add(rid, _routed(source, rid).receipt_json())
    assert honest.run(fin).valid_row_count == 2 and fin.dims_cache.dims == (L, K)
    again = _routed(source, "odd2", layers=32, topk=16)
    out = Group(group_id="g4").add("odd2", again.receipt_json()).add("later", later.receipt_json()).run(fin)
    assert out.rejections == [(0, "odd2", "route_assembly:fragment_model_shape")]
    assert out.rows[1].routed_experts.shape == (40, L, K) and (out.rows[1].routed_experts == -1).all()


def test_the_majority_of_a_group_settles_its_dims():
    source = InMemoryTokenSource()
    fin = Reassembler(source, DIRECT)
    group = Group().add("odd", _routed(source, "odd", layers=3, topk=1).receipt_json())
    for rid in ("a", "b"):
        group.add(rid, _routed(source, rid).receipt_json())
    out = group.run(fin)
    assert out.rejections == [(0, "odd", "route_assembly:fragment_model_shape")]
    assert out.routed_experts.shape == (3, 4, L, K) and fin.dims_cache.dims == (L, K)
    assert torch.equal(out.rows[1].routed_experts, out.rows[2].routed_experts)
