"""The named workload profiles: the agentic-moe sizes are what the profile says they are."""

import dataclasses

import numpy as np
import pytest

from stage.contract import decode_routed_experts, verify_and_linearize
from stage.routes import ROUTED_EXPERTS_FIELD
from stage.workload import (
    AGENTIC_MOE,
    PROFILE_NAMES,
    TOY,
    WorkloadConfig,
    describe,
    generate,
    generate_group,
    profile,
)


def test_profiles_are_named_and_overridable():
    assert PROFILE_NAMES == (TOY, AGENTIC_MOE)
    assert profile(TOY, groups=3).groups == 3
    moe = profile(AGENTIC_MOE)
    assert (moe.group_size, moe.routes, moe.route_dtypes) == (16, (48, 8), ("int8", "int16"))
    assert moe.rollout_tokens == (32_768, 131_072)
    with pytest.raises(ValueError, match="unknown workload profile"):
        profile("huge")
    assert "N=16" in describe(moe, AGENTIC_MOE) and "L=48 K=8 int8/int16" in describe(moe)


def test_agentic_rollouts_have_the_profiles_lengths_and_call_counts():
    # routes off: the token plan is drawn before (and independently of) any route
    cfg = profile(AGENTIC_MOE, route_layers=0, groups=3)
    lengths, calls = [], []
    for group in generate(cfg).groups:
        assert group.group_size == 16
        for rollout in group.rollouts:
            chain = [c for c in rollout.calls if c.role == "chain"]
            assert 56 <= len(chain) <= 64
            lengths.append(sum(c.record.delta_len for c in chain))
            calls.append(len(rollout.calls))
            row = verify_and_linearize(rollout.receipt, [c.record.base_snapshot() for c in rollout.calls])
            assert len(row.token_ids) == lengths[-1]
    assert max(lengths) <= 131_072 and min(lengths) >= 1024
    assert 20_000 < np.mean(lengths) < 48_000          # 48 draws around a 32k mean
    assert max(lengths) > 2 * np.median(lengths) * 0.9  # a heavy tail
    assert 58 <= np.mean(calls) <= 72                   # retries and side calls on top


def test_route_dtypes_are_drawn_per_rollout_and_routes_are_held_in_them():
    cfg = profile(AGENTIC_MOE, route_layers=3, route_topk=2, rollout_tokens=(2_000, 8_000),
                  prompt_tokens=(64, 128), turns=(4, 6), groups=1)
    group = generate_group(cfg, 0)
    dtypes = {r.calls[0].route_dtype for r in group.rollouts}
    assert dtypes == {"int8", "int16"}
    for rollout in group.rollouts:
        for call in rollout.calls:
            assert call.route_dtype == rollout.calls[0].route_dtype
            assert call.routed_experts.dtype == np.dtype(call.route_dtype)
            assert call.routed_experts.shape == (call.record.delta_len, 3, 2)
            envelope = call.record.extras[ROUTED_EXPERTS_FIELD]
            assert envelope.startswith(f"nrlre1:{call.route_dtype}:")
            assert np.array_equal(decode_routed_experts(envelope).values, call.routed_experts)
            assert call.stage_kwargs()["route_dtype"] == call.route_dtype


def test_a_single_route_dtype_draws_nothing_so_toy_workloads_are_unchanged():
    base = WorkloadConfig(groups=2, seed=5)
    a = generate(base)
    b = generate(dataclasses.replace(base, route_dtype=("int16",)))
    assert [c.record.digest for r in a.rollouts for c in r.calls] == \
        [c.record.digest for r in b.rollouts for c in r.calls]


def test_profile_settings_are_validated():
    with pytest.raises(ValueError, match="do not fit route_dtype int8"):
        WorkloadConfig(route_dtype="int8", num_experts=300)
    with pytest.raises(ValueError, match="route_dtype must be one of"):
        WorkloadConfig(route_dtype="int4")
    with pytest.raises(ValueError, match="mean, max"):
        WorkloadConfig(rollout_tokens=(10_000, 5_000))
