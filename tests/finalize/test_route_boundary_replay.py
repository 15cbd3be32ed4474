"""Turn-boundary route replay through finalization (spec §3.2 BOUNDARY, §9 route_boundary_replay).

vLLM never routes a call's last sampled token; the child routes it during prefill and stages a
one-row sidecar for canonical index ``prev_len - 1``. The expected tensor is built here by
"Ray splicing": concatenate every chain call's delta routes, then overwrite each child's
``prev_len - 1`` row with its boundary route.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from stage.finalize import InMemoryTokenSource, Reassembler, ReassemblyConfig
from stage.routes import execute_route_plan
from tests.finalize.factory import (
    CallSpec,
    Group,
    SpySource,
    boundary_values,
    route_extras,
    route_values,
    stage_rollout,
    tamper_row,
)

L, K = 2, 2
DIRECT = dict(router_replay=True)
DEFERRED = dict(router_replay=True, defer_routes=True)
LEGACY_WARNING = ("Legacy captured call c2 has no boundary route; retaining the previous token's route. "
                  "Fresh capture is required for turn-boundary replay parity.")


def chain(turns: int, *, dtype: str = "int16", sentinel: bool = False, boundary: bool = True):
    """Root c1 (carry 2, gen 2) then children c2..cN (carry 1, gen 2), each with routes and,
    unless ``boundary`` is False, a boundary sidecar. Returns (specs, expected tokens, routes)."""
    specs, tokens, mask, lps, spliced = [], [], [], [], []
    for t in range(1, turns + 1):
        prompt = [10, 11] if t == 1 else [10 * t]
        gen = [10 * t + 2, 10 * t + 3]
        values = route_values(t, len(prompt) + len(gen), small=True)
        kw = {}
        if t > 1 and boundary:
            b = boundary_values(t, sentinel=sentinel, small=True)
            kw = dict(boundary=b, boundary_index=len(tokens) - 1)
            spliced[-1] = b[0]
        specs.append(CallSpec(f"c{t}", None if t == 1 else f"c{t - 1}", prompt, gen,
                              [-0.25 * t, -0.5 * t], extras=route_extras(values, dtype=dtype, **kw)))
        tokens += prompt + gen
        mask += [0.0] * len(prompt) + [1.0, 1.0]
        lps += [0.0] * len(prompt) + [-0.25 * t, -0.5 * t]
        spliced += list(values)
    return specs, (tokens, mask, lps), torch.tensor(np.array(spliced), dtype=torch.int16)


def worker_assemble(source, plan, canonical_len):
    fragments = {s.staging_key: source.rows[s.staging_key].fragment()
                 for s in plan.spans if s.staged_route_len > 0}
    return execute_route_plan(plan, fragments, dims=(L, K), canonical_len=canonical_len)


@pytest.mark.parametrize("dtype", ["int8", "int16"])
@pytest.mark.parametrize("sentinel", [False, True], ids=["routed", "sentinel"])
@pytest.mark.parametrize("mode", ["direct", "deferred"])
@pytest.mark.parametrize("turns", [1, 2, 3])
def test_boundary_routes_equal_ray_splicing(turns, mode, sentinel, dtype):
    """§9 route_boundary_replay 1."""
    source = InMemoryTokenSource()
    specs, (tokens, mask, lps), expected = chain(turns, dtype=dtype, sentinel=sentinel)
    staged = stage_rollout(source, "r", specs)
    spy = SpySource(source)
    fin = Reassembler(spy, ReassemblyConfig(**(DIRECT if mode == "direct" else DEFERRED)))
    out = Group().add("r", staged.receipt_json(), 1.0).run(fin)
    row = out.rows[0]
    assert row.valid, row.rejection_reason
    assert row.input_ids.tolist() == tokens
    assert row.token_mask.tolist() == mask
    assert torch.equal(row.generation_logprobs, torch.tensor(lps, dtype=torch.float32))
    assert [r.sample_mask for r in out.rows] == [1.0]
    children = [f"r/c{t}" for t in range(2, turns + 1)]
    if mode == "direct":
        assert spy.fetch_calls[0][1]["include_route_fragments"] is True
        assert row.routed_experts.dtype == torch.int16
        assert torch.equal(row.routed_experts, expected)
        # A sentinel boundary leaves each repaired parent token without any route.
        sentinel_rows = (turns - 1) if sentinel else 0
        assert out.metrics["finalize/routed_experts_sentinel_token_fraction"] == sentinel_rows / len(tokens)
        assert out.metrics["finalize/routed_experts_row_coverage"] == 1.0
    else:
        assert [kw["include_route_fragments"] for _, kw in spy.fetch_calls] == [False]  # no route bytes read
        plan = row.route_plan
        assert [s.staging_key for s in plan.spans if s.repair_previous_token] == children
        assert [s.boundary_token_index for s in plan.spans] == \
            [None] + [4 + 3 * (t - 2) - 1 for t in range(2, turns + 1)]
        tensor, failure = worker_assemble(source, plan, row.input_lengths)
        assert failure is None                                          # no fallback
        assert tensor.dtype == torch.int16 and torch.equal(tensor, expected)


@pytest.mark.parametrize("mode", ["direct", "deferred"])
def test_only_the_selected_child_repairs_its_parent(mode):
    """§9 route_boundary_replay 2: root + abandoned child + selected child."""
    source = InMemoryTokenSource()
    root = route_values(1, 4)
    abandoned_boundary, selected_boundary = boundary_values(5), boundary_values(6)
    specs = [CallSpec("c1", None, [10, 11], [12, 13], extras=route_extras(root)),
             CallSpec("a1", "c1", [30], [31, 32], extras=route_extras(
                 route_values(5, 3), boundary=abandoned_boundary, boundary_index=3)),
             CallSpec("c2", "c1", [20], [21, 22], extras=route_extras(
                 route_values(6, 3), boundary=selected_boundary, boundary_index=3))]
    staged = stage_rollout(source, "r", specs, terminal="c2")
    config = DIRECT if mode == "direct" else DEFERRED
    row = Group().add("r", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(**config))).rows[0]
    assert row.valid, row.rejection_reason
    assert row.input_ids.tolist() == [10, 11, 12, 13, 20, 21, 22]
    expected = np.concatenate([root[:-1], selected_boundary, route_values(6, 3)])
    if mode == "direct":
        routes = row.routed_experts
    else:
        assert "r/a1" not in [s.staging_key for s in row.route_plan.spans]     # never read by the worker
        assert "r/a1" in row.route_plan.cleanup_staging_keys                   # but still owned
        routes, failure = worker_assemble(source, row.route_plan, row.input_lengths)
        assert failure is None
    assert routes.tolist() == expected.tolist()
    assert source.rows["r/c1"].routes.tolist() == root.tolist()               # parent fragment unmodified


@pytest.mark.parametrize("damage", ["tampered", "missing"])
def test_bad_boundary_sidecar(damage):
    """§9 route_boundary_replay 3: deferred -> all -1 and the row trains; direct -> rejected."""
    source = InMemoryTokenSource()
    specs, _, _ = chain(2)
    staged = stage_rollout(source, "r", specs)
    sidecar = source.rows["r/c2"].boundary_routes
    tamper_row(source, "r/c2", boundary_routes=None if damage == "missing" else sidecar + 1)

    deferred = Group().add("r", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(**DEFERRED)))
    row = deferred.rows[0]
    assert row.valid and row.sample_mask == 1.0
    tensor, failure = worker_assemble(source, row.route_plan, row.input_lengths)
    assert (tensor, failure) == (None, "fragment_integrity")   # worker fills -1 and counts one fallback

    direct = Reassembler(source, ReassemblyConfig(**DIRECT)).finalize_rollout("r", staged.receipt_json(),
                                                                                reward=0.0)
    assert direct.rejection_reason == "route_assembly:fragment_integrity"


@pytest.mark.parametrize("mode", ["direct", "deferred"])
def test_legacy_child_without_boundary_fields(mode, caplog):
    """§9 route_boundary_replay 5: root + child routes, no repair, one legacy WARNING."""
    source = InMemoryTokenSource()
    specs, _, _ = chain(2, boundary=False)
    staged = stage_rollout(source, "r", specs)
    config = DIRECT if mode == "direct" else DEFERRED
    with caplog.at_level(logging.WARNING):
        row = Group().add("r", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(**config))).rows[0]
    assert row.valid
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [LEGACY_WARNING]
    expected = np.concatenate([route_values(1, 4, small=True), route_values(2, 3, small=True)])
    if mode == "direct":
        routes = row.routed_experts
    else:
        assert not any(s.repair_previous_token for s in row.route_plan.spans)
        routes, failure = worker_assemble(source, row.route_plan, row.input_lengths)
        assert failure is None
    assert routes.tolist() == expected.tolist()


@pytest.mark.parametrize("config", [DIRECT, DEFERRED], ids=["direct", "deferred"])
def test_middle_call_with_empty_generation_is_rejected_without_plan(config):
    """§9 route_boundary_replay 6."""
    source = InMemoryTokenSource()
    specs = [CallSpec("c1", None, [10, 11], [12, 13], extras=route_extras(route_values(1, 4))),
             CallSpec("c2", "c1", [20, 21], [], extras=route_extras(route_values(2, 2))),   # no boundary
             CallSpec("c3", "c2", [30], [31], extras=route_extras(
                 route_values(3, 2), boundary=boundary_values(3), boundary_index=5))]
    staged = stage_rollout(source, "r", specs)
    assert "routed_experts_boundary" not in staged.calls["c2"].record.extras
    out = Reassembler(source, ReassemblyConfig(**config)).finalize_rollout("r", staged.receipt_json(), reward=0.0)
    assert not out.valid
    assert "empty_generation" in out.rejection_reason
    assert out.rejection_reason.startswith("rebuild_failed:empty_generation: call c2")
    assert out.route_plan is None and out.routed_experts is None
