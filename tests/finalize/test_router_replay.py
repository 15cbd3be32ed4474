"""Router replay (R3) through finalization: direct vs deferred mode, route guards, the group
route tensor and the structural drop (spec §2 guards 15-22, §3.7, §3.9, §3.10, §4.6)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from stage.contract import compute_extras_digest
from stage.finalize import InMemoryTokenSource, Reassembler, ReassemblyConfig, pad_group
from stage.finalize.group import DROP_NO_ROUTE_DIMS
from stage.routes import (
    METRIC_ROUTED_EXPERTS_ROW_COVERAGE as COVERAGE,
    METRIC_ROUTED_EXPERTS_SENTINEL_TOKEN_FRACTION as SENTINEL_FRACTION,
    UNKNOWN_ROUTE_DIMS_MESSAGE,
    decode_route_plan,
    dumps_route_plan,
    encode_route_plan,
    encoded_route_plan_size_bytes,
    execute_route_plan,
    loads_route_plan,
)
from tests.finalize.factory import (
    CallSpec,
    Group,
    SpySource,
    golden_specs,
    route_extras,
    route_values,
    stage_rollout,
    tamper_row,
)

L, K = 2, 2
PARTITION = "rollouts.staged-calls"
DIRECT = dict(router_replay=True)
DEFERRED = dict(router_replay=True, defer_routes=True)


def chain_routes() -> torch.Tensor:
    """What a legacy (no boundary) golden rollout assembles to: c1 rows then c2 rows."""
    return torch.tensor(np.concatenate([route_values(1, 4), route_values(2, 3)]), dtype=torch.int16)


def worker_assemble(source: InMemoryTokenSource, plan, canonical_len: int, dims=(L, K)):
    """The policy worker's deferred assembly: decode the published plan from its wire bytes,
    read the fragments of spans with staged routes, run the shared executor."""
    decoded = loads_route_plan(dumps_route_plan(plan))
    fragments = {s.staging_key: source.rows[s.staging_key].fragment()
                 for s in decoded.spans if s.staged_route_len > 0}
    return execute_route_plan(decoded, fragments, dims=dims, canonical_len=canonical_len)


@pytest.fixture
def routed():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "grp_g0", golden_specs(routes="int16"))
    return source, staged


# --- direct mode --------------------------------------------------------------------------------


def test_direct_routes_published(routed):
    """§9 rollout_reassembler 11."""
    source, staged = routed
    spy = SpySource(source)
    out = Group().add("grp_g0", staged.receipt_json(), 1.0).add("grp_g1", None).run(
        Reassembler(spy, ReassemblyConfig(**DIRECT)))
    assert spy.fetch_calls == [(["grp_g0/c1", "grp_g0/c2"],
                                {"include_route_fragments": True, "include_topk": False})]
    valid, placeholder = out.rows
    assert valid.routed_experts.dtype == torch.int16
    assert torch.equal(valid.routed_experts, chain_routes())
    assert placeholder.routed_experts.shape == (1, L, K)
    assert (placeholder.routed_experts == -1).all()
    assert out.routed_experts.shape == (2, 7, L, K) and out.routed_experts.dtype == torch.int16
    assert torch.equal(out.routed_experts[0], chain_routes())
    assert (out.routed_experts[1] == -1).all()
    assert out.metrics[COVERAGE] == 1.0
    assert out.metrics[SENTINEL_FRACTION] == 0.0
    assert out.staging_keys == []                                  # direct: nothing retained
    assert out.cleanup_staging_keys == ["grp_g0/c1", "grp_g0/c2"]
    assert valid.route_plan is None and placeholder.route_plan is None   # plans are deferred-only tags
    t = pad_group(out)
    assert t["routed_experts"].dtype == torch.int16 and t["routed_experts"].shape == (2, 7, L, K)
    assert torch.equal(t["routed_experts"][0], chain_routes())
    assert (t["routed_experts"][1] == -1).all()                     # placeholder and padding are -1


def test_direct_rows_own_their_routes_and_the_padded_group_tensor_waits_to_be_asked(routed):
    """A row's routes are its own (not a view of a padded [N, max_len, L, K] tensor: at agentic
    sizes one long row would pad every other); the group tensor is built on first use."""
    source, staged = routed
    out = Group().add("grp_g0", staged.receipt_json(), 1.0).add("grp_g1", None).run(
        Reassembler(source, ReassemblyConfig(**DIRECT)))
    valid, placeholder = out.rows
    assert out._routed_experts is None
    assert valid.routed_experts.untyped_storage().nbytes() == valid.routed_experts.nbytes
    assert placeholder.routed_experts.untyped_storage().nbytes() == placeholder.routed_experts.nbytes
    group = out.routed_experts
    assert out._routed_experts is group and out.routed_experts is group     # built once
    assert torch.equal(group[0], chain_routes()) and (group[1] == -1).all()


def test_direct_rollout_route_plan_and_tensor(routed):
    source, staged = routed
    out = Reassembler(source, ReassemblyConfig(**DIRECT)).finalize_rollout("grp_g0", staged.receipt_json(),
                                                                            reward=0.0)
    assert out.valid
    assert torch.equal(out.routed_experts, chain_routes())
    assert out.route_plan is not None
    assert [(s.staging_key, s.carry_len, s.generation_len, s.staged_route_len) for s in out.route_plan.spans] \
        == [("grp_g0/c1", 2, 2, 4), ("grp_g0/c2", 1, 2, 3)]


@pytest.mark.parametrize("routes", ["int8", "int16", "int32", "list"])
def test_direct_output_is_int16_whatever_was_staged(routes):
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", golden_specs(routes=routes, small=True))
    out = Group().add("a", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(**DIRECT)))
    assert out.rows[0].valid, out.rows[0].rejection_reason
    expected = np.concatenate([route_values(1, 4, small=True), route_values(2, 3, small=True)])
    assert out.rows[0].routed_experts.dtype == torch.int16
    assert out.rows[0].routed_experts.tolist() == expected.tolist()


def test_direct_without_any_staged_routes_and_unknown_dims_rejects_the_rows_instead_of_raising():
    """§9 rollout_reassembler 12 raises RuntimeError (UNKNOWN_ROUTE_DIMS_MESSAGE): NeMo RL fails
    loudly, and the stage would halt the partition on it for good. Here the valid rows are
    rejected with a named reason and the group is the structural drop (nothing to shape)."""
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", golden_specs())
    out = Group().add("a", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(**DIRECT)))
    assert out.rejections == [(0, "a", "route_dims_unknown")]
    assert out.dropped and out.drop_reason == DROP_NO_ROUTE_DIMS and out.rows == []


def test_configured_dims_shape_rows_without_routes_from_the_first_group():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", golden_specs())
    config = ReassemblyConfig(**DIRECT, route_layers=L, route_topk=K)
    out = Group().add("a", staged.receipt_json()).add("b", None).run(Reassembler(source, config))
    assert not out.dropped and out.valid_row_count == 1
    assert out.rows[0].routed_experts.shape == (7, L, K) and (out.rows[0].routed_experts == -1).all()
    assert out.routed_experts.shape == (2, 7, L, K)
    only_placeholders = Group(group_id="g2").add("x", None).run(Reassembler(InMemoryTokenSource(), config))
    assert not only_placeholders.dropped and only_placeholders.routed_experts.shape == (1, 1, L, K)


def test_routes_that_contradict_the_configured_dims_reject_their_rollout(routed):
    source, staged = routed                                            # staged with (L, K) = (2, 2)
    config = ReassemblyConfig(**DIRECT, route_layers=3, route_topk=1)
    fin = Reassembler(source, config)
    out = Group().add("grp_g0", staged.receipt_json()).add("b", None).run(fin)
    assert out.rows[0].rejection_reason == "route_assembly:fragment_model_shape"
    assert out.routed_experts.shape == (2, 1, 3, 1)
    assert fin.dims_cache.dims == (3, 1)                               # never relearned


def test_rows_of_one_group_with_different_learned_dims_reject_the_odd_one_instead_of_raising():
    """Without configured dims NeMo RL takes the first valid row's routes as the group's (L, K)
    (§3.9) and raises RuntimeError for a row of other dims, which would halt the stage's
    partition. Here the dims most of the group's rows carry settle it (stage.routes.dims), and
    the odd row is rejected, wherever it stands."""
    source = InMemoryTokenSource()
    other = stage_rollout(source, "b", [
        CallSpec("c1", None, [10, 11], [12, 13], extras=route_extras(route_values(1, 4, layers=3, topk=1)))])
    group = Group().add("b", other.receipt_json())
    for rid in ("a", "c"):
        group.add(rid, stage_rollout(source, rid, golden_specs(routes="int16")).receipt_json())
    out = group.run(Reassembler(source, ReassemblyConfig(**DIRECT)))
    assert out.rows[0].rejection_reason == "route_assembly:fragment_model_shape"
    assert out.rows[1].valid and out.rows[1].routed_experts.shape == (7, L, K)
    assert out.routed_experts.shape == (3, 7, L, K)


def test_two_rows_with_different_learned_dims_and_nothing_agreed_settle_none():
    """One against one, before any dims are agreed: neither can say what the model is."""
    source = InMemoryTokenSource()
    first = stage_rollout(source, "a", golden_specs(routes="int16"))
    other = stage_rollout(source, "b", [
        CallSpec("c1", None, [10, 11], [12, 13], extras=route_extras(route_values(1, 4, layers=3, topk=1)))])
    out = (Group().add("a", first.receipt_json()).add("b", other.receipt_json())
           .run(Reassembler(source, ReassemblyConfig(**DIRECT))))
    assert out.rejections == [(0, "a", "route_dims_unknown"), (1, "b", "route_dims_unknown")]
    assert out.dropped and out.drop_reason == DROP_NO_ROUTE_DIMS


def test_route_dims_are_set_together():
    with pytest.raises(ValueError, match="set both or neither"):
        ReassemblyConfig(**DIRECT, route_layers=48)


def agree_on_dims(source, staged, fin) -> None:
    """Two rollouts with (L, K) routes: the learned dims are agreed (stage.routes.dims)."""
    second = stage_rollout(source, "grp_g1", golden_specs(routes="int16"))
    Group().add("grp_g0", staged.receipt_json()).add("grp_g1", second.receipt_json()).run(fin)
    assert fin.dims_cache.dims == (L, K)


def test_direct_row_without_routes_is_all_sentinel_once_dims_are_agreed(routed):
    source, staged = routed
    fin = Reassembler(source, ReassemblyConfig(**DIRECT))
    agree_on_dims(source, staged, fin)
    plain = stage_rollout(source, "p", golden_specs())
    out = Group().add("p", plain.receipt_json()).run(fin)
    assert out.rows[0].valid
    assert out.rows[0].routed_experts.shape == (7, L, K) and (out.rows[0].routed_experts == -1).all()
    assert out.metrics[COVERAGE] == 0.0
    assert out.metrics[SENTINEL_FRACTION] == 1.0


def test_structural_drop_when_nothing_can_shape_the_route_tensor():
    source = InMemoryTokenSource()
    poisoned = stage_rollout(source, "b", golden_specs(routes="int16"))
    out = (Group().add("a", None, 1.0).add("b", poisoned.receipt_json(capture_poisoned=True))
           .run(Reassembler(source, ReassemblyConfig(**DIRECT)), fallback_weight_version=6))
    assert out.dropped is True
    assert out.drop_reason == DROP_NO_ROUTE_DIMS == \
        "router replay on, no rollout carried routed_experts, and (L, K) is unknown yet"
    assert out.rows == []
    assert (out.valid_row_count, out.total_row_count) == (0, 0)
    assert out.canonical_output_tokens == 0
    assert out.staging_keys == []
    assert out.cleanup_staging_keys == ["b/c1", "b/c2"]                 # staging still cleared
    assert (out.group_min_wv, out.group_max_wv) == (6, 6)
    assert out.metrics["finalize/group_dropped"] == 1.0
    assert out.routed_experts is None


def test_no_structural_drop_once_dims_are_agreed(routed):
    source, staged = routed
    fin = Reassembler(source, ReassemblyConfig(**DIRECT))
    agree_on_dims(source, staged, fin)
    out = Group(group_id="next").add("a", None).add("b", None).run(fin)
    assert not out.dropped and len(out.rows) == 2
    assert out.routed_experts.shape == (2, 1, L, K) and (out.routed_experts == -1).all()
    assert "finalize/group_dropped" not in out.metrics


def test_no_structural_drop_in_deferred_or_plain_mode():
    for config in (DEFERRED, {}):
        out = Group().add("a", None).run(Reassembler(InMemoryTokenSource(), ReassemblyConfig(**config)))
        assert not out.dropped and len(out.rows) == 1


def test_tampered_fragment_in_direct_mode_is_fragment_integrity(routed):
    """§9 rollout_reassembler 16."""
    source, staged = routed
    routes = source.rows["grp_g0/c2"].routes.copy()
    routes[0, 0, 0] += 1
    tamper_row(source, "grp_g0/c2", routes=routes)
    out = Reassembler(source, ReassemblyConfig(**DIRECT)).finalize_rollout("grp_g0", staged.receipt_json(),
                                                                            reward=0.5)
    assert out.rejection_reason == "route_assembly:fragment_integrity"
    assert out.valid is False and out.reward == 0.5 and out.routed_experts is None
    assert out.staging_keys == ["grp_g0/c1", "grp_g0/c2"]


def test_dtype_changed_in_transport_is_fragment_integrity(routed):
    source, staged = routed
    tamper_row(source, "grp_g0/c1", routes=source.rows["grp_g0/c1"].routes.astype(np.int32))
    out = Reassembler(source, ReassemblyConfig(**DIRECT)).finalize_rollout("grp_g0", staged.receipt_json(),
                                                                            reward=0.0)
    assert out.rejection_reason == "route_assembly:fragment_integrity"


def test_off_chain_fragment_with_other_dims_is_fragment_model_shape():
    """Direct mode learns (L, K) from the first fetched fragment in manifest order."""
    source = InMemoryTokenSource()
    specs = [CallSpec("c1", None, [1, 2], [3, 4], extras=route_extras(route_values(1, 4))),
             CallSpec("dead", "c1", [5], [6], extras=route_extras(route_values(3, 2, layers=3, topk=1))),
             CallSpec("c2", "c1", [7], [8], extras=route_extras(route_values(2, 2)))]
    staged = stage_rollout(source, "a", specs, terminal="c2", order=["dead", "c1", "c2"])
    out = Reassembler(source, ReassemblyConfig(**DIRECT)).finalize_rollout("a", staged.receipt_json(), reward=0.0)
    assert out.rejection_reason == "route_assembly:fragment_model_shape"


# --- route plan guards --------------------------------------------------------------------------


@pytest.mark.parametrize("config", [DIRECT, DEFERRED], ids=["direct", "deferred"])
def test_staged_route_length_not_delta_len_is_routed_len_mismatch(routed, config):
    """§9 rollout_reassembler 14 (999 rows staged for a 3-token delta)."""
    source, staged = routed
    tamper_row(source, "grp_g0/c2", routes=np.zeros((999, L, K), dtype=np.int16))
    out = Reassembler(source, ReassemblyConfig(**config)).finalize_rollout("grp_g0", staged.receipt_json(),
                                                                            reward=0.0)
    assert out.rejection_reason == "routed_len_mismatch:c2"
    assert out.route_plan is None


def test_injected_negative_routed_len_is_routed_len_mismatch(routed):
    """§9 rollout_reassembler 14 (routed_len -1, injected by the source)."""
    source, staged = routed

    def rewrite(items):
        return [items[0], replace(items[1], routed_len=-1)]

    out = Reassembler(SpySource(source, rewrite), ReassemblyConfig(**DEFERRED)).finalize_rollout(
        "grp_g0", staged.receipt_json(), reward=0.0)
    assert out.rejection_reason == "routed_len_mismatch:c2"


def test_boundary_index_at_the_wrong_position_is_route_boundary_index_mismatch():
    source = InMemoryTokenSource()
    specs = golden_specs(routes="int16", boundary="real")
    specs[1].extras["routed_experts_boundary_index"] = 2          # must be prev_len - 1 == 3
    staged = stage_rollout(source, "a", specs)
    for config in (DIRECT, DEFERRED):
        out = Reassembler(source, ReassemblyConfig(**config)).finalize_rollout("a", staged.receipt_json(),
                                                                                reward=0.0)
        assert out.rejection_reason == "route_boundary_index_mismatch:c2"


def test_invalid_plan_is_invalid_route_plan(routed):
    source, staged = routed
    # the configuration refuses an empty name; model_copy skips that to reach the plan's own check
    config = ReassemblyConfig(**DEFERRED).model_copy(update={"staging_partition": ""})
    out = Reassembler(source, config).finalize_rollout(
        "grp_g0", staged.receipt_json(), reward=0.0)
    assert out.rejection_reason == "invalid_route_plan:route_plan.staging_partition must be a non-empty string"


def test_route_guards_run_only_after_rebuild(routed):
    source, staged = routed
    receipt = staged.receipt_json()
    receipt["manifest"][1]["extras_digest"] = "0" * 64
    out = Reassembler(source, ReassemblyConfig(**DIRECT)).finalize_rollout("grp_g0", receipt, reward=0.0)
    assert out.rejection_reason.startswith("rebuild_failed:wrong_extras_digest: call c2:")
    assert out.route_plan is None


# --- deferred mode ------------------------------------------------------------------------------


def test_deferred_publishes_plans_not_routes(routed):
    """§9 rollout_reassembler 13."""
    source, staged = routed
    spy = SpySource(source)
    fin = Reassembler(spy, ReassemblyConfig(**DEFERRED))
    out = Group().add("grp_g0", staged.receipt_json(), 1.0).add("grp_g1", None).run(fin)
    assert spy.fetch_calls[0][1] == {"include_route_fragments": False, "include_topk": False}
    assert out.routed_experts is None
    assert all(row.routed_experts is None for row in out.rows)
    assert out.staging_keys == ["grp_g0/c1", "grp_g0/c2"]            # ownership handed to the caller
    assert set(out.staging_keys) == {k for r in out.rows for k in r.route_plan.cleanup_staging_keys}
    assert set(source.rows) == {"grp_g0/c1", "grp_g0/c2"}            # staging retained
    valid, placeholder = out.rows
    plan = valid.route_plan
    assert plan.staging_partition == PARTITION
    assert plan.expected_token_length == 7 == valid.input_lengths
    assert plan.cleanup_staging_keys == ("grp_g0/c1", "grp_g0/c2")
    assert [(s.carry_len, s.generation_len, s.staged_route_len) for s in plan.spans] == [(2, 2, 4), (1, 2, 3)]
    assert placeholder.route_plan.spans == ()
    assert placeholder.route_plan.expected_token_length == 1
    assert placeholder.route_plan.cleanup_staging_keys == ()
    m = out.metrics
    assert m["finalize/route_plan_span_count"] == 2.0
    assert m["finalize/route_plan_encoded_bytes"] == float(
        encoded_route_plan_size_bytes(plan) + encoded_route_plan_size_bytes(placeholder.route_plan))
    assert m[COVERAGE] == 1.0
    # The policy worker reproduces the routes, and -1 for the placeholder.
    tensor, failure = worker_assemble(source, plan, valid.input_lengths)
    assert failure is None and torch.equal(tensor, chain_routes())
    tensor, failure = worker_assemble(source, placeholder.route_plan, placeholder.input_lengths)
    assert failure is None and tensor.shape == (1, L, K) and (tensor == -1).all()


def test_deferred_placeholder_plan_keeps_the_rejected_rollouts_keys(routed):
    source, staged = routed
    out = Group().add("grp_g0", staged.receipt_json(capture_poisoned=True)).run(
        Reassembler(source, ReassemblyConfig(**DEFERRED)))
    plan = out.rows[0].route_plan
    assert not out.rows[0].valid
    assert plan.spans == () and plan.expected_token_length == 1
    assert plan.cleanup_staging_keys == ("grp_g0/c1", "grp_g0/c2")
    assert out.staging_keys == ["grp_g0/c1", "grp_g0/c2"]
    assert decode_route_plan(encode_route_plan(plan)) == plan


def test_deferred_valid_row_without_routes_publishes_its_sentinel_plan():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", golden_specs())
    out = Group().add("a", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(**DEFERRED)))
    plan = out.rows[0].route_plan
    assert [s.staged_route_len for s in plan.spans] == [0, 0]
    assert out.metrics[COVERAGE] == 1.0          # coverage counts plans with spans
    tensor, failure = worker_assemble(source, plan, 7)
    assert failure is None and (tensor == -1).all()


def test_direct_and_deferred_agree_byte_for_byte():
    """§9 rollout_reassembler 15."""
    source = InMemoryTokenSource()
    specs = [CallSpec("c1", None, [10, 11], [12, 13], extras=route_extras(route_values(1, 4), tag="x")),
             CallSpec("dead", "c1", [14], [15], weight_version=3, extras=route_extras(route_values(9, 2))),
             CallSpec("c2", "c1", [20], [21, 22], extras=route_extras(
                 route_values(2, 3), boundary=route_values(7, 1), boundary_index=3))]
    staged = stage_rollout(source, "a", specs, terminal="c2")
    direct = Group().add("a", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(**DIRECT)))
    deferred = Group().add("a", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(**DEFERRED)))
    d_row, f_row = direct.rows[0], deferred.rows[0]
    assert d_row.valid and f_row.valid
    for name in ("input_ids", "token_mask", "generation_logprobs", "prompt_ids_for_adv"):
        assert torch.equal(getattr(d_row, name), getattr(f_row, name))
    direct_plan = Reassembler(source, ReassemblyConfig(**DIRECT)).finalize_rollout(
        "a", staged.receipt_json(), reward=0.0).route_plan
    assert dumps_route_plan(direct_plan) == dumps_route_plan(f_row.route_plan)
    manifest = {row["staging_key"]: row["extras_digest"] for row in staged.receipt_json()["manifest"]}
    assert [s.extras_digest for s in f_row.route_plan.spans] == [manifest["a/c1"], manifest["a/c2"]]
    assert manifest["a/c2"] == compute_extras_digest(specs[2].extras)
    assert f_row.route_plan.cleanup_staging_keys == ("a/c1", "a/dead", "a/c2")
    assert (direct.group_min_wv, deferred.group_min_wv) == (3, 3)
    # The worker's executor on fragments read from the source equals the direct tensor.
    tensor, failure = worker_assemble(source, f_row.route_plan, f_row.input_lengths)
    assert failure is None
    assert torch.equal(tensor, d_row.routed_experts)
    expected = np.concatenate([route_values(1, 4), route_values(2, 3)])
    expected[3] = route_values(7, 1)[0]
    assert d_row.routed_experts.tolist() == expected.tolist()


def test_deferred_tampered_fragment_trains_and_falls_back_at_the_worker(routed):
    source, staged = routed
    routes = source.rows["grp_g0/c1"].routes.copy()
    routes[-1] = 0
    tamper_row(source, "grp_g0/c1", routes=routes)
    out = Group().add("grp_g0", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(**DEFERRED)))
    row = out.rows[0]
    assert row.valid and row.sample_mask == 1.0                        # the finalizer never read routes
    assert worker_assemble(source, row.route_plan, row.input_lengths) == (None, "fragment_integrity")
