"""finalize_group (spec §4): exactly N rows, placeholder semantics, columns, metrics, pad_group."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from stage.contract import RolloutReceipt
from stage.finalize import (
    FinalizedGroup,
    REJECTION_LOGGER,
    InMemoryTokenSource,
    Reassembler,
    ReassemblyConfig,
    pad_group,
)
from stage.routes import resolve_device
from tests.finalize.factory import (
    GOLDEN_LOGPROBS,
    GOLDEN_MASK,
    GOLDEN_TOKENS,
    CallSpec,
    Group,
    golden_specs,
    stage_rollout,
)

METHODS = ("declared", "response_id", "content", "heuristic")


def f32(values):
    return torch.tensor(values, dtype=torch.float32)


@pytest.fixture
def source():
    return InMemoryTokenSource()


def test_group_with_placeholder(source):
    """§9 rollout_reassembler 3."""
    staged = stage_rollout(source, "grp_g0", golden_specs(), selection="heuristic")
    group = Group().add("grp_g0", staged.receipt_json(), 1.0, False).add("grp_g1", None, 0.0, True)
    fin = Reassembler(source, ReassemblyConfig(max_seq_len=len(GOLDEN_TOKENS)))
    out = group.run(fin, loss_multiplier=0.25, canonical_sample_ids=["grp_g0", "grp_g1"])

    assert isinstance(out, FinalizedGroup) and not out.dropped
    assert [r.sample_id for r in out.rows] == ["grp_g0", "grp_g1"]
    assert [r.rollout_id for r in out.rows] == ["grp_g0", "grp_g1"]
    assert [r.prompt_idx for r in out.rows] == [17, 17]
    assert [r.group_id for r in out.rows] == ["grp", "grp"]
    assert (out.group_min_wv, out.group_max_wv) == (4, 4)                 # not the fallback 9
    assert [r.weight_version for r in out.rows] == [4, 4]
    assert (out.valid_row_count, out.total_row_count) == (1, 2)
    m = out.metrics
    assert m["finalize/invalid_row_rate"] == 0.5
    assert m["finalize/media_row_rate"] == 0.0
    assert m["finalize/terminal_selection_heuristic_count"] == 1.0
    assert m["finalize/terminal_selection_heuristic_fraction"] == 0.5
    assert m["finalize/terminal_selection_declared_count"] == 0.0
    assert m["finalize/terminal_witness_disagreement_count"] == 0.0
    assert out.canonical_output_tokens == int(sum(GOLDEN_MASK)) == 4
    valid, placeholder = out.rows
    assert [r.sample_mask for r in out.rows] == [0.25, 0.0]
    assert torch.equal(valid.input_ids, torch.tensor(GOLDEN_TOKENS, dtype=torch.int64))
    assert torch.equal(valid.token_mask, f32(GOLDEN_MASK))
    assert torch.equal(valid.generation_logprobs, f32(GOLDEN_LOGPROBS))   # float32-rounded
    assert valid.input_ids.dtype == torch.int64 and valid.token_mask.dtype == torch.float32
    assert valid.generation_logprobs.dtype == torch.float32
    assert placeholder.prompt_ids_for_adv.tolist() == [10, 11]             # borrowed from g0
    assert valid.prompt_ids_for_adv.tolist() == [10, 11]
    assert placeholder.token_mask.tolist() == [0.0] and placeholder.input_ids.tolist() == [0]
    assert placeholder.generation_logprobs.tolist() == [0.0]
    assert [r.total_reward for r in out.rows] == [1.0, 0.0]
    assert [r.mask_sample for r in out.rows] == [False, True]
    assert [r.truncated for r in out.rows] == [True, False]
    assert [r.valid for r in out.rows] == [True, False]
    assert placeholder.rejection_reason == "missing_receipt"
    # Staging ownership (what the caller clears): every manifest key; direct/off mode keeps none.
    assert out.staging_keys == []
    assert out.cleanup_staging_keys == ["grp_g0/c1", "grp_g0/c2"]


def test_terminal_selection_none_counts_as_poisoned_failure_in_no_bucket(source):
    """§9 rollout_reassembler 4."""
    staged = stage_rollout(source, "g0", golden_specs(), selection="heuristic")
    failed = staged.receipt_json(manifest=[], capture_poisoned=True, rollout_id="g1",
                                 failure_reason="missing_terminal_row",
                                 terminal_model_call_id=None, terminal_selection=None)
    out = Group().add("g0", staged.receipt_json(), 1.0).add("g1", failed, 0.5).run(Reassembler(source))
    m = out.metrics
    assert m["finalize/invalid_row_rate"] == 0.5
    assert m["finalize/capture_poisoned_rollouts"] == 1.0
    assert m["finalize/capture_failure_reason_rollout_failed_count"] == 1.0
    assert "finalize/terminal_selection_None_count" not in m
    assert not any("None" in key for key in m)
    assert sum(m[f"finalize/terminal_selection_{x}_count"] for x in METHODS) == 1.0
    assert out.rows[1].total_reward == 0.5                                  # reward kept


def test_physical_attempt_id_published_under_canonical_id(source):
    """§9 rollout_reassembler 8."""
    staged = stage_rollout(source, "stable_g0_aattempt", golden_specs())
    group = Group(group_id="stable").add("stable_g0_aattempt", staged.receipt_json(), 1.0)
    out = group.run(Reassembler(source), canonical_sample_ids=["stable_g0"])
    assert out.rows[0].valid
    assert out.rows[0].sample_id == "stable_g0"
    assert out.rows[0].rollout_id == "stable_g0_aattempt"


def test_canonical_sample_ids_must_equal_minted_ids(source):
    staged = stage_rollout(source, "r0", golden_specs())
    group = Group(group_id="grp").add("r0", staged.receipt_json())
    with pytest.raises((AssertionError, ValueError), match=re.escape(
            "canonical sample ids must equal the stable logical rollout ids: ['grp_g0'] != ['r0']")):
        group.run(Reassembler(source), canonical_sample_ids=["r0"])


def test_physical_rollout_ids_publish_under_canonical_ids_when_none_are_declared(source):
    # Deliberate difference from NeMo RL (which defaults canonical_sample_ids to rollout_ids):
    # on Kafka a rollout id is a physical attempt id, and a producer that wants the check sends
    # canonical_sample_id on its ReceiptEvent. Without one, rows publish as {group_id}_g{i}.
    staged = stage_rollout(source, "r0", golden_specs())
    out = Reassembler(source).finalize_group("grp", ["r0"], [staged.receipt_json()], [1.0], mask_sample=[False],
                                             fallback_weight_version=9, prompt_idx=17)
    assert [(r.sample_id, r.rollout_id, r.valid) for r in out.rows] == [("grp_g0", "r0", True)]
    with pytest.raises(ValueError, match=re.escape(
            "canonical sample ids must equal the stable logical rollout ids: ['grp_g0'] != ['r0']")):
        Reassembler(source).finalize_group("grp", ["r0"], [staged.receipt_json()], [1.0], mask_sample=[False],
                                           fallback_weight_version=9, prompt_idx=17, canonical_sample_ids=["r0"])


def test_default_canonical_ids_accept_logical_rollout_ids(source):
    staged = stage_rollout(source, "grp_g0", golden_specs())
    out = Reassembler(source).finalize_group("grp", ["grp_g0"], [staged.receipt_json()], [1.0],
                                             mask_sample=[False], fallback_weight_version=9, prompt_idx=17)
    assert [r.sample_id for r in out.rows] == ["grp_g0"] and out.rows[0].valid


def test_inputs_must_be_parallel(source):
    with pytest.raises((AssertionError, ValueError),
                       match="rollout_ids, receipts, rewards, and mask_sample must be parallel"):
        Reassembler(source).finalize_group("grp", ["a", "b"], [None, None], [0.0], mask_sample=[False, False],
                                           fallback_weight_version=1, prompt_idx=0)


def test_per_label_stats(source):
    """§9 rollout_reassembler 9: raw counts per (scope, name); result stats harness-only."""
    staged = stage_rollout(source, "g0", golden_specs())
    group = Group().add("g0", staged.receipt_json(), 1.0).add("g1", None, 0.0)
    out = group.run(Reassembler(source, ReassemblyConfig(max_seq_len=7)),
                    group_labels=[("harness", "claude/code"), ("agent", "swe")],
                    result_stats=[("harness_finished", 1, 2)])
    m = out.metrics
    h, a = "group_stats/harness/claude_code", "group_stats/agent/swe"
    expected = {"groups": 1.0, "rollouts": 2.0, "trained": 1.0, "placeholders": 1.0, "mask_sample": 0.0,
                "all_reward_sum": 1.0, "reward_sum": 1.0, "pass_count": 1.0, "gen_tokens_sum": 4.0,
                "gen_tokens_pass_sum": 4.0, "gen_tokens_fail_sum": 0.0, "turns_sum": 2.0,
                "seq_len_sum": 7.0, "truncated": 1.0, "calls_sum": 2.0}
    for prefix in (h, a):
        assert {k[len(prefix) + 1:]: v for k, v in m.items() if k.startswith(prefix + "/")
                and "/result_" not in k} == expected
    assert m[f"{h}/result_sum/harness_finished"] == 1.0
    assert m[f"{h}/result_count/harness_finished"] == 2.0
    assert not any(k.startswith(f"{a}/result_") for k in m)
    assert "group_stats/harness/claude/code/groups" not in m                 # "/" -> "_"


def test_per_label_stats_failure_does_not_lose_the_group(source):
    staged = stage_rollout(source, "g0", golden_specs())
    out = Group().add("g0", staged.receipt_json(), 1.0).run(
        Reassembler(source), group_labels=[("harness", "h")], result_stats=[("harness_finished", 1)])
    assert len(out.rows) == 1 and out.rows[0].valid
    assert not any(k.startswith("group_stats/") for k in out.metrics)


def test_label_stats_with_mask_sample_and_mixed_rewards():
    source = InMemoryTokenSource()
    a = stage_rollout(source, "a", golden_specs())
    b = stage_rollout(source, "b", [CallSpec("c1", None, [1], [2, 3, 4])])
    c = stage_rollout(source, "c", golden_specs())
    out = (Group().add("a", a.receipt_json(), 1.0).add("b", b.receipt_json(), 0.0)
           .add("c", c.receipt_json(), 0.25, True).run(Reassembler(source), group_labels=[("agent", "x")]))
    m = {k.rsplit("/", 1)[1]: v for k, v in out.metrics.items() if k.startswith("group_stats/agent/x/")}
    assert m["trained"] == 2.0 and m["mask_sample"] == 1.0 and m["placeholders"] == 0.0
    assert m["all_reward_sum"] == 1.25 and m["reward_sum"] == 1.0 and m["pass_count"] == 1.0
    assert m["gen_tokens_pass_sum"] == 4.0 and m["gen_tokens_fail_sum"] == 3.0
    assert m["turns_sum"] == 3.0 and m["seq_len_sum"] == 11.0 and m["calls_sum"] == 3.0
    assert (m["multi"], m["mixed"], m["all_pass"], m["all_fail"]) == (1.0, 1.0, 0.0, 0.0)


def test_unlabelled_group_emits_no_group_stats(source):
    staged = stage_rollout(source, "g0", golden_specs())
    out = Group().add("g0", staged.receipt_json(), 1.0).run(Reassembler(source),
                                                            result_stats=[("x", 1, 1)])
    assert not any(k.startswith("group_stats/") for k in out.metrics)


def test_all_none_group_is_published_as_placeholders(source):
    """§9 rollout_reassembler 10."""
    fin = Reassembler(source, ReassemblyConfig(pad_token_id=5))
    out = Group().add("a", None, 0.5).add("b", None, 0.25, True).run(fin, fallback_weight_version=3)
    assert not out.dropped and out.drop_reason is None
    assert len(out.rows) == 2
    assert (out.valid_row_count, out.total_row_count) == (0, 2)
    assert (out.group_min_wv, out.group_max_wv) == (3, 3)
    assert out.canonical_output_tokens == 0
    for row in out.rows:
        assert row.input_ids.tolist() == [5] and row.input_lengths == 1
        assert row.prompt_ids_for_adv.tolist() == [5]                       # [pad] when none valid
        assert row.sample_mask == 0.0
        assert row.weight_version == 3
    assert [r.total_reward for r in out.rows] == [0.5, 0.25]
    assert [r.mask_sample for r in out.rows] == [False, True]
    assert out.metrics["finalize/invalid_row_rate"] == 1.0
    assert out.metrics["finalize/capture_failure_reason_missing_receipt_count"] == 2.0


def test_exactly_n_rows_and_prompt_from_first_valid_sibling():
    source = InMemoryTokenSource()
    first = stage_rollout(source, "g1", [CallSpec("c1", None, [7, 8, 9], [1, 2])])
    second = stage_rollout(source, "g2", golden_specs())
    poisoned = stage_rollout(source, "g3", golden_specs(wv2=1))
    fin = Reassembler(source, ReassemblyConfig(pad_token_id=3))
    out = (Group().add("g0", None, 0.1)
           .add("g1", first.receipt_json(), 0.2)
           .add("g2", second.receipt_json(), 0.3, True)
           .add("g3", poisoned.receipt_json(capture_poisoned=True), 0.4)
           .run(fin, loss_multiplier=2.0))
    assert len(out.rows) == 4
    assert [r.row_index for r in out.rows] == [0, 1, 2, 3]
    assert [r.group_size for r in out.rows] == [4, 4, 4, 4]
    assert [r.valid for r in out.rows] == [False, True, True, False]
    for row in out.rows:                         # same sibling prompt for every row (GRPO baseline)
        assert row.prompt_ids_for_adv.tolist() == [7, 8, 9]
    assert [r.sample_mask for r in out.rows] == [0.0, 2.0, 2.0, 0.0]
    assert [r.input_lengths for r in out.rows] == [1, 5, 7, 1]
    assert out.rows[0].input_ids.tolist() == [3] and out.rows[3].input_ids.tolist() == [3]
    assert [r.total_reward for r in out.rows] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert [r.mask_sample for r in out.rows] == [False, False, True, False]
    assert (out.valid_row_count, out.total_row_count) == (2, 4)
    # wv bounds over valid rows only: the poisoned rollout's wv 1 does not count.
    assert (out.group_min_wv, out.group_max_wv) == (4, 4)
    assert out.canonical_output_tokens == 2 + 4
    assert out.cleanup_staging_keys == ["g1/c1", "g2/c1", "g2/c2", "g3/c1", "g3/c2"]
    m = out.metrics
    assert m["finalize/calls_per_rollout"] == 5 / 4
    assert m["finalize/invalid_row_rate"] == 0.5
    assert m["finalize/token_in_calls"] == 2.0 and m["finalize/text_root_calls"] == 3.0
    assert m["finalize/token_in_rate"] == 2 / 5
    assert m["finalize/capture_poisoned_rollouts"] == 1.0
    assert m["finalize/terminal_selection_declared_count"] == 3.0
    assert m["finalize/terminal_selection_declared_fraction"] == 3 / 4     # None receipts in denominator
    assert m["finalize/capture_failure_reason_missing_receipt_count"] == 1.0
    assert m["finalize/capture_failure_reason_capture_poisoned_count"] == 1.0


def test_weight_versions_span_valid_rollouts_including_off_chain():
    source = InMemoryTokenSource()
    a = stage_rollout(source, "a", [CallSpec("c1", None, [1], [2], weight_version=6),
                                    CallSpec("dead", "c1", [3], [4], weight_version=3),
                                    CallSpec("c2", "c1", [5], [6], weight_version=7)], terminal="c2")
    b = stage_rollout(source, "b", golden_specs(wv2=11))
    out = Group().add("a", a.receipt_json()).add("b", b.receipt_json()).run(Reassembler(source))
    assert (out.group_min_wv, out.group_max_wv) == (3, 11)
    assert [r.weight_version for r in out.rows] == [3, 3]
    assert [r.group_max_wv for r in out.rows] == [11, 11]


def test_mixed_weight_versions_in_one_rollout():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", golden_specs(wv2=5))
    out = Group().add("a", staged.receipt_json()).run(Reassembler(source))
    assert (out.group_min_wv, out.group_max_wv) == (4, 5)


@pytest.mark.parametrize("max_seq_len, expected", [(6, [False, False]), (7, [True, False]),
                                                   (8, [False, False]), (1, [False, True])])
def test_truncated_is_exact_equality_with_max_seq_len(source, max_seq_len, expected):
    staged = stage_rollout(source, "a", golden_specs())
    out = Group().add("a", staged.receipt_json()).add("b", None).run(
        Reassembler(source, ReassemblyConfig(max_seq_len=max_seq_len)))
    assert [r.truncated for r in out.rows] == expected


def test_no_max_seq_len_never_truncates(source):
    staged = stage_rollout(source, "a", golden_specs())
    out = Group().add("a", staged.receipt_json()).add("b", None).run(Reassembler(source))
    assert [r.truncated for r in out.rows] == [False, False]


def test_group_metric_names_and_timings(source):
    staged = stage_rollout(source, "a", golden_specs())
    witness = staged.receipt_json(terminal_attribution_reason="declared; witness_disagreement: content")
    out = Group().add("a", witness, 1.0).run(Reassembler(source))
    m = out.metrics
    names = {"finalize/invalid_row_rate", "finalize/calls_per_rollout", "finalize/media_row_rate",
             "finalize/token_in_calls", "finalize/text_root_calls", "finalize/token_in_rate",
             "finalize/capture_poisoned_rollouts", "finalize/terminal_witness_disagreement_count",
             "row_assembly/rollouts_ms", "row_assembly/tensorize_ms"}
    names |= {f"finalize/terminal_selection_{x}_{s}" for x in METHODS for s in ("count", "fraction")}
    assert names <= m.keys()
    assert m["finalize/terminal_witness_disagreement_count"] == 1.0
    assert m["finalize/invalid_row_rate"] == 0.0
    assert m["finalize/token_in_rate"] == 0.5
    assert not any(k.startswith("finalize/capture_failure_reason_") for k in m)
    assert "finalize/group_dropped" not in m
    assert all(isinstance(v, float) for v in m.values())
    assert m["row_assembly/rollouts_ms"] >= 0 and m["row_assembly/tensorize_ms"] >= 0


def test_manifest_metrics_absent_when_no_manifest_rows(source):
    out = Group().add("a", None).run(Reassembler(source))
    assert "finalize/token_in_rate" not in out.metrics
    assert "finalize/token_in_calls" not in out.metrics


def test_empty_prompt_of_first_valid_sibling_falls_back_to_pad():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", [CallSpec("c1", None, [], [4, 5])])   # no prompt tokens
    out = Group().add("a", staged.receipt_json()).add("b", None).run(
        Reassembler(source, ReassemblyConfig(pad_token_id=2)))
    assert out.rows[0].valid
    assert [r.prompt_ids_for_adv.tolist() for r in out.rows] == [[2], [2]]


# --- pad_group ---------------------------------------------------------------------------------


def test_pad_group_shapes_dtypes_and_padding():
    source = InMemoryTokenSource()
    short = stage_rollout(source, "s", [CallSpec("c1", None, [7, 8], [9])])
    longer = stage_rollout(source, "l", golden_specs())
    fin = Reassembler(source, ReassemblyConfig(pad_token_id=1, max_seq_len=7))
    out = (Group().add("s", short.receipt_json(), 0.5, True).add("l", longer.receipt_json(), 1.0)
           .add("x", None, -1.0).run(fin, loss_multiplier=0.5))
    t = pad_group(out, pad_token_id=1)
    assert t["input_ids"].dtype == torch.int64 and t["input_ids"].shape == (3, 7)
    assert t["input_ids"].tolist() == [[7, 8, 9, 1, 1, 1, 1], GOLDEN_TOKENS, [1] * 7]
    assert t["input_lengths"].dtype == torch.int64 and t["input_lengths"].tolist() == [3, 7, 1]
    for name in ("generation_logprobs", "token_mask"):
        assert t[name].dtype == torch.float32 and t[name].shape == (3, 7)
    assert t["token_mask"].tolist() == [[0, 0, 1, 0, 0, 0, 0], GOLDEN_MASK, [0] * 7]
    assert torch.equal(t["generation_logprobs"][1], f32(GOLDEN_LOGPROBS))
    assert t["generation_logprobs"][0, 3:].tolist() == [0.0] * 4
    assert t["sample_mask"].dtype == torch.float32 and t["sample_mask"].tolist() == [0.5, 0.5, 0.0]
    assert t["total_reward"].dtype == torch.float32 and t["total_reward"].tolist() == [0.5, 1.0, -1.0]
    assert t["mask_sample"].dtype == torch.bool and t["mask_sample"].tolist() == [True, False, False]
    assert t["truncated"].dtype == torch.bool and t["truncated"].tolist() == [False, True, False]
    assert t["prompt_ids_for_adv"].dtype == torch.int64
    assert t["prompt_ids_for_adv"].tolist() == [[7, 8]] * 3
    assert "routed_experts" not in t and "generation_topk_ids" not in t


def test_pad_group_refuses_a_dropped_group():
    dropped = FinalizedGroup("g", [], 1, 1, [], [], 0, {}, 0, 0, dropped=True, drop_reason="why")
    with pytest.raises(ValueError, match="no rows"):
        pad_group(dropped)


# --- device ---------------------------------------------------------------------------------------


def test_tensors_are_on_the_configured_device(source):
    staged = stage_rollout(source, "a", golden_specs())
    out = Group().add("a", staged.receipt_json()).add("b", None).run(
        Reassembler(source, ReassemblyConfig(device="cpu")))
    for row in out.rows:
        for t in (row.input_ids, row.token_mask, row.generation_logprobs, row.prompt_ids_for_adv):
            assert t.device == torch.device("cpu")
    assert all(t.device.type == "cpu" for t in pad_group(out).values())


def test_auto_device_resolves_without_cuda(source):
    staged = stage_rollout(source, "a", golden_specs())
    out = Group().add("a", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(device="auto")))
    expected = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto").type == expected.type
    assert out.rows[0].input_ids.device.type == expected.type
    assert out.rows[0].input_ids.tolist() == GOLDEN_TOKENS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure mode")
def test_cuda_device_without_cuda_fails_loudly(source):
    staged = stage_rollout(source, "a", golden_specs())
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        Group().add("a", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(device="cuda")))


def test_config_rejects_deferral_without_router_replay():
    # NeMo RL's message, inside pydantic's ValidationError (a ValueError)
    with pytest.raises(ValueError, match="defer_routed_experts_to_policy requires router replay to be enabled"):
        ReassemblyConfig(defer_routes=True)


RECEIPT_FORMS = {
    "dict": lambda d: d,
    "text": lambda d: json.dumps(d),
    "bytes": lambda d: json.dumps(d).encode("utf-8"),
    "object": RolloutReceipt.from_json,
}


def _mixed_group_receipts(source):
    """heuristic + witness disagreement (valid), declared + poisoned, and a missing receipt."""
    a = stage_rollout(source, "a", golden_specs(), selection="heuristic")
    b = stage_rollout(source, "b", golden_specs())
    return [a.receipt_json(terminal_attribution_reason="heuristic; witness_disagreement: content"),
            b.receipt_json(capture_poisoned=True), None]


@pytest.mark.parametrize("form", sorted(RECEIPT_FORMS))
def test_group_metrics_are_the_same_whatever_form_the_receipts_come_in(source, form):
    """Issue 12 item 2: metrics come from the receipt as finalize_rollout parsed it."""
    receipts = _mixed_group_receipts(source)
    want = Group().add("a", receipts[0]).add("b", receipts[1]).add("c", None).run(Reassembler(source)).metrics
    convert = RECEIPT_FORMS[form]
    group = Group()
    for rid, receipt in zip("abc", receipts):
        group.add(rid, None if receipt is None else convert(receipt))
    got = group.run(Reassembler(source)).metrics
    assert {k: v for k, v in got.items() if not k.startswith("row_assembly/")} == \
        {k: v for k, v in want.items() if not k.startswith("row_assembly/")}
    assert got["finalize/token_in_rate"] == 0.5
    assert (got["finalize/token_in_calls"], got["finalize/text_root_calls"]) == (2.0, 2.0)
    assert got["finalize/terminal_selection_heuristic_count"] == 1.0
    assert got["finalize/terminal_selection_heuristic_fraction"] == 1 / 3
    assert got["finalize/terminal_selection_declared_count"] == 1.0
    assert got["finalize/terminal_witness_disagreement_count"] == 1.0
    assert got["finalize/capture_poisoned_rollouts"] == 1.0
    assert got["finalize/invalid_row_rate"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("form", ["dict", "text", "bytes"])
def test_an_invalid_receipt_counts_by_its_raw_fields_in_every_form(source, form):
    """A receipt that fails validation is read with NeMo RL's raw-dict rules (its decoded
    JSON object), so text and bytes count exactly as the dict does."""
    staged = stage_rollout(source, "a", golden_specs(), selection="heuristic")
    # poisoned but no failure_reason and no selection: Gym refuses it (invalid_receipt)
    invalid = staged.receipt_json(capture_poisoned=True, terminal_selection=None, terminal_model_call_id=None,
                                  terminal_attribution_reason="witness_disagreement")
    out = Group().add("a", RECEIPT_FORMS[form](invalid)).run(Reassembler(source))
    assert out.rows[0].rejection_reason.startswith("invalid_receipt:")
    m = out.metrics
    assert m["finalize/capture_poisoned_rollouts"] == 1.0
    assert m["finalize/token_in_calls"] == 1.0 and m["finalize/text_root_calls"] == 1.0
    assert m["finalize/terminal_witness_disagreement_count"] == 1.0
    assert sum(m[f"finalize/terminal_selection_{x}_count"] for x in METHODS) == 0.0


def test_unreadable_receipts_count_in_no_receipt_metric(source):
    garbage = ["{not json", b"\xff\xfe", "[1, 2]", {"manifest": "x", "capture_poisoned": "yes",
                                                     "terminal_selection": 3}]
    group = Group()
    for i, receipt in enumerate(garbage):
        group.add(f"r{i}", receipt)
    out = group.run(Reassembler(source))
    assert all(r.rejection_reason.startswith("invalid_receipt:") for r in out.rows)
    m = out.metrics
    assert "finalize/token_in_rate" not in m
    assert m["finalize/capture_poisoned_rollouts"] == 0.0
    assert sum(m[f"finalize/terminal_selection_{x}_count"] for x in METHODS) == 0.0


def test_every_rejection_is_logged_once_as_nemo_rl_prints_it(source, caplog):
    """Issue 12 item 4: one INFO line per placeholder on its own logger, valid rows silent."""
    caplog.set_level(logging.INFO, logger=REJECTION_LOGGER)
    good = stage_rollout(source, "a", golden_specs())
    poisoned = stage_rollout(source, "c", golden_specs())
    Group().add("a", good.receipt_json()).add("b", None).add("c", poisoned.receipt_json(capture_poisoned=True)) \
        .run(Reassembler(source))
    lines = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name == REJECTION_LOGGER]
    assert lines == [(REJECTION_LOGGER, logging.INFO, "finalize: rollout b rejected (missing_receipt) — placeholder"),
                     (REJECTION_LOGGER, logging.INFO, "finalize: rollout c rejected (capture_poisoned) — placeholder")]
    assert not [r for r in caplog.records if "rejected" in r.getMessage() and r.name != REJECTION_LOGGER]


def test_rejections_are_logged_even_when_the_group_drops(source, caplog):
    caplog.set_level(logging.INFO, logger=REJECTION_LOGGER)
    out = Group().add("a", None).run(Reassembler(source, ReassemblyConfig(router_replay=True)))
    assert out.dropped
    assert [r.getMessage() for r in caplog.records if r.name == REJECTION_LOGGER] == [
        "finalize: rollout a rejected (missing_receipt) — placeholder"]


@pytest.mark.parametrize("value", ["WARNING", "off", "40"])
def test_the_rejection_log_is_silenced_by_its_level(source, caplog, value):
    from stage.runtime.kafka.logs import apply_rejection_log_level
    caplog.set_level(logging.INFO)
    log = logging.getLogger(REJECTION_LOGGER)
    before = log.level
    try:
        apply_rejection_log_level({"ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL": value})
        Group().add("a", None).run(Reassembler(source))
        assert not [r for r in caplog.records if r.name == REJECTION_LOGGER]
        apply_rejection_log_level({"ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL": "info"})
        Group().add("a", None).run(Reassembler(source))
        assert len([r for r in caplog.records if r.name == REJECTION_LOGGER]) == 1
    finally:
        log.setLevel(before)
