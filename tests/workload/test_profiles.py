"""The named workload profiles: the agentic-moe and frontier sizes are what the profiles say
they are, and a frontier call's records, routes staged by reference, fit the record cap."""

import dataclasses

import numpy as np
import pytest

from stage.contract import decode_routed_experts, verify_and_linearize
from stage.routes import ROUTED_EXPERTS_FIELD
from stage.workload import (
    AGENTIC_MOE,
    FRONTIER,
    PROFILE_NAMES,
    TOY,
    WorkloadConfig,
    describe,
    generate,
    generate_group,
    profile,
)


def test_profiles_are_named_and_overridable():
    assert PROFILE_NAMES == (TOY, AGENTIC_MOE, FRONTIER)
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


# -- frontier: Nemotron-3-Super-like router replay at agentic sizes -----------------------------

FRONTIER_BYTES_PER_TOKEN = 40 * 22 * 2        # 40 MoE layers x top-22, int16


def test_frontier_is_agentic_traffic_at_a_frontier_models_route_dims():
    cfg, moe = profile(FRONTIER), profile(AGENTIC_MOE)
    assert (cfg.group_size, cfg.routes, cfg.route_dtypes, cfg.num_experts) == (16, (40, 22), ("int16",), 512)
    assert cfg.rollout_tokens == (32_768, 131_072) and cfg.turns == (56, 64)
    for name in ("groups", "turns", "prompt_tokens", "rollout_tokens", "retry_rate", "side_call_rate",
                 "version_bump_rate", "media_rate"):
        assert getattr(cfg, name) == getattr(moe, name), name
    assert "N=16" in describe(cfg, FRONTIER) and "L=40 K=22 int16" in describe(cfg)
    # the figures: 1,760 B/token; a 128k-token rollout ~225 MB, 16 of them ~3.4 GiB
    assert FRONTIER_BYTES_PER_TOKEN == 1_760
    assert 131_072 * FRONTIER_BYTES_PER_TOKEN * 16 / 2**30 == pytest.approx(3.44, abs=0.01)


def test_frontier_rollouts_have_the_profiles_lengths_and_call_counts():
    cfg = profile(FRONTIER, route_layers=0, groups=2)    # the token plan does not depend on routes
    lengths, calls = [], []
    for group in generate(cfg).groups:
        assert group.group_size == 16
        for rollout in group.rollouts:
            chain = [c for c in rollout.calls if c.role == "chain"]
            assert 56 <= len(chain) <= 64
            lengths.append(sum(c.record.delta_len for c in chain))
            calls.append(len(rollout.calls))
    assert max(lengths) <= 131_072 and min(lengths) >= 1024
    assert 18_000 < np.mean(lengths) < 52_000          # 32 draws around a 32k mean
    assert 58 <= np.mean(calls) <= 72


def test_frontier_routes_are_int16_of_40_layers_by_22_of_512_experts():
    # scaled down: short rollouts, the real route dims
    cfg = profile(FRONTIER, rollout_tokens=(600, 1_200), prompt_tokens=(64, 128), turns=(4, 6),
                  group_size=2, groups=1)
    group = generate_group(cfg, 0)
    highest = 0
    for rollout in group.rollouts:
        for call in rollout.calls:
            routes = call.routed_experts
            assert routes.dtype == np.int16 and routes.shape == (call.record.delta_len, 40, 22)
            assert routes.nbytes == call.record.delta_len * FRONTIER_BYTES_PER_TOKEN
            assert np.array_equal(decode_routed_experts(call.record.extras[ROUTED_EXPERTS_FIELD]).values, routes)
            highest = max(highest, int(routes.max()))
            if call.parent_call_id is not None:
                assert call.routed_experts_boundary.shape == (1, 40, 22)
    assert 256 < highest < 512                            # ids of 512 experts, beyond int8


def _by_reference(value: dict, routes_bytes: int, dims: tuple[int, int], chunk_bytes: int):
    """``value`` (a StagedCall without routes) staged by reference: its RouteChunk values and
    the StagedCall naming them, as docs/producers.md lays them out."""
    from stage.staging.route_refs import ChunkRef, RouteReference, chunk_sha256, chunk_value, split_payload
    payload = bytearray(routes_bytes)
    pieces = split_payload(payload, chunk_bytes)
    chunks = [chunk_value(value["group_id"], value["staging_key"], i, len(pieces), piece)
              for i, piece in enumerate(pieces)]
    reference = RouteReference("rollouts.staged-routes", 3, "int16", (value["delta_len"], *dims),
                               tuple(ChunkRef(1_000_000 + i, len(p), chunk_sha256(p)) for i, p in enumerate(pieces)))
    boundary = {"dtype": "int16", "shape": [1, *dims], "data": bytes(dims[0] * dims[1] * 2)}
    staged = {**value, "route_encoding": 1, "routed_experts": None, "routes_ref": reference.to_value(),
              "routed_experts_boundary": boundary,
              "extras_metadata_json": '{"routed_experts_boundary_index":131071}'}
    return chunks, staged, reference


def test_a_frontier_call_staged_by_reference_fits_the_record_cap():
    """Issue 26 item 4: the longest call a frontier rollout can make (all 128k tokens in one
    call: 225 MB of routes, 28x the cap inline) is records under the default cap once its routes
    go by reference: RouteChunk records of DEFAULT_ROUTE_CHUNK_BYTES, the StagedCall (token
    columns, boundary route, reference) and a RoutePlan naming 64 such calls."""
    from stage.bench.wire import staged_call_record
    from stage.staging.route_refs import DEFAULT_ROUTE_CHUNK_BYTES
    from stage.wire import DEFAULT_MAX_RECORD_BYTES, AvroCodec
    tokens = 131_072
    routes_bytes = tokens * FRONTIER_BYTES_PER_TOKEN
    assert routes_bytes > 28 * DEFAULT_MAX_RECORD_BYTES
    chunks, staged, reference = _by_reference(staged_call_record(tokens), routes_bytes, (40, 22),
                                              DEFAULT_ROUTE_CHUNK_BYTES)
    assert len(chunks) == 55 and sum(c.length for c in reference.chunks) == routes_bytes
    chunk_codec = AvroCodec("RouteChunk")
    assert chunk_codec.max_record_bytes == DEFAULT_MAX_RECORD_BYTES
    sizes = [len(chunk_codec.encode(chunk)) for chunk in (chunks[0], chunks[-1])]   # all but the last alike
    assert max(sizes) <= DEFAULT_MAX_RECORD_BYTES
    staged_size = len(AvroCodec("StagedCall").encode(staged))           # Gym's u64/f64 token columns
    assert staged_size <= DEFAULT_MAX_RECORD_BYTES
    span = {"staging_key": staged["staging_key"], "carry_len": 0, "generation_len": tokens // 2,
            "staged_route_len": tokens, "extras_digest_version": 1, "extras_digest": "0" * 64,
            "boundary_token_index": None, "repair_previous_token": False, "fragment": None,
            "chunks": {"reference": reference.to_value(), "route_encoding": 1,
                       "extras_metadata_json": staged["extras_metadata_json"],
                       "boundary": staged["routed_experts_boundary"]}}
    plan = {"group_id": staged["group_id"], "sample_id": "s" * 64, "row_index": 15, "schema_version": 3,
            "staging_partition": "rollouts.staged-calls", "spans": [span] * 64,
            "cleanup_staging_keys": [staged["staging_key"]] * 64, "expected_token_length": 64 * tokens}
    plan_size = len(AvroCodec("RoutePlan").encode(plan))
    assert plan_size <= DEFAULT_MAX_RECORD_BYTES
    print(f"\nfrontier 128k-token call by reference: {len(chunks)} chunks of <= {max(sizes):,} B, "
          f"StagedCall {staged_size:,} B, RoutePlan of 64 such spans {plan_size:,} B")


def test_a_frontier_profile_calls_inline_routes_are_what_the_profile_says():
    """Until producers stage by reference, a frontier call's inline StagedCall is its delta's
    routes plus ~12 bytes a token: the profile's own sizes, which the benchmarks encode."""
    from stage.bench.inputs import group_inputs
    from stage.wire import AvroCodec
    cfg = profile(FRONTIER, rollout_tokens=(600, 1_200), prompt_tokens=(64, 128), turns=(4, 6),
                  group_size=2, groups=1)
    inputs = group_inputs(cfg, 0)
    codec = AvroCodec("StagedCall")
    staged = [codec.decode(v) for role, v in inputs.records if role == "staged_calls"]
    assert inputs.route_bytes == sum(len(v["routed_experts"]["data"]) + len((v["routed_experts_boundary"]
                                                                              or {"data": b""})["data"])
                                     for v in staged)
    for value in staged:
        assert len(value["routed_experts"]["data"]) == value["delta_len"] * FRONTIER_BYTES_PER_TOKEN
