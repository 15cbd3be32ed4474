"""Realistic records of every schema, shaped as the stage produces and consumes them.

StagedCall and ReceiptEvent come from the bench builders (Gym's producer rules, real digests);
the outputs mirror NeMo RL's published columns. ``expected(name, record)`` is what a decode
returns: the record with every omitted defaulted field filled in.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from stage.wire import pack_tensor, schema_json
from stage.bench.wire import GROUP_ID, receipt_event_record, staged_call_record

RNG = np.random.default_rng(7)
DIGEST = "ab" * 32


def packed_tensor() -> dict:
    return pack_tensor(RNG.standard_normal((3, 5)).astype(np.float32))


def staged_call_full() -> dict:
    """A token_in child call with routes, boundary route, media and top-k."""
    record = staged_call_record(96, routes=(4, 2), seed=1)
    record.update(
        parent_call_id="call-prev", mode="token_in", prev_len=40, cum_len=136,
        routed_experts_boundary=pack_tensor(np.full((1, 4, 2), 3, np.int16)),
        media={"imgs": pack_tensor(torch.randn(1, 4, 12).to(torch.bfloat16)),
               "imgs_sizes": pack_tensor(np.array([[28, 28]], np.int32)),
               "num_frames": None},
        topk={"ids": pack_tensor(RNG.integers(0, 1000, (48, 5)).astype(np.int32)),
              "logprobs": pack_tensor(-RNG.random((48, 5)).astype(np.float32))})
    return record


def receipt_missing() -> dict:
    """A missing_receipt placeholder: defaulted fields left out on purpose."""
    return {"group_id": GROUP_ID, "rollout_id": "rollout-5", "rollout_index": 5,
            "group_size": 8, "prompt_idx": 4242, "reward": 0.0, "receipt": None}


def canonical_row(valid: bool = True) -> dict:
    n = 20 if valid else 1
    row = {
        "group_id": GROUP_ID, "sample_id": f"{GROUP_ID}_g2", "row_index": 2, "group_size": 8,
        "prompt_idx": 4242, "rollout_id": "rollout-2", "weight_version": 17, "group_max_wv": 18,
        "valid": valid, "rejection_reason": None if valid else "digest_mismatch:rollout-2/call-1",
        "input_ids": pack_tensor(RNG.integers(0, 151_000, n).astype(np.int64)),
        "input_lengths": n,
        "generation_logprobs": pack_tensor(np.zeros(n, np.float32)),
        "token_mask": pack_tensor(np.r_[np.zeros(n // 2), np.ones(n - n // 2)].astype(np.float32)),
        "sample_mask": 1.0 if valid else 0.0,
        "prompt_ids_for_adv": pack_tensor(RNG.integers(0, 151_000, 10).astype(np.int64)),
        "total_reward": 0.75, "mask_sample": False, "truncated": not valid,
    }
    if valid:
        row.update(
            routed_experts=pack_tensor(np.full((n, 4, 2), -1, np.int16)),
            generation_topk_ids=pack_tensor(RNG.integers(0, 1000, (n, 5)).astype(np.int32)),
            generation_topk_logprobs=pack_tensor(-RNG.random((n, 5)).astype(np.float32)),
            pixel_values=pack_tensor(torch.randn(1, 4, 12).to(torch.bfloat16)),
            imgs_sizes=pack_tensor(np.array([[28, 28]], np.int32)),
            num_frames=None)
    return row


def route_plan() -> dict:
    span = {"staging_key": "rollout-2/call-0", "carry_len": 0, "generation_len": 12,
            "staged_route_len": 32, "extras_digest_version": 1, "extras_digest": DIGEST,
            "boundary_token_index": None, "repair_previous_token": False,
            "fragment": {"topic": "rollouts.staged-calls", "partition": 3, "offset": 918_273}}
    child = {**span, "staging_key": "rollout-2/call-1", "carry_len": 6, "staged_route_len": 0,
             "boundary_token_index": 31, "repair_previous_token": True, "fragment": None}
    return {"group_id": GROUP_ID, "sample_id": f"{GROUP_ID}_g2", "row_index": 2,
            "schema_version": 3, "staging_partition": "3", "spans": [span, child],
            "cleanup_staging_keys": ["rollout-2/call-0", "rollout-2/call-1"],
            "expected_token_length": 50}


def group_summary() -> dict:
    return {
        "group_id": GROUP_ID, "group_size": 8, "prompt_idx": 4242, "outcome": "deadline",
        "valid_rows": 6, "total_rows": 8, "group_min_wv": 17, "group_max_wv": 18,
        "drop_reason": None, "canonical_output_tokens": 5_120,
        "rejections": [{"row_index": 5, "rollout_id": "rollout-5", "reason": "missing_receipt"},
                       {"row_index": 6, "rollout_id": "rollout-6",
                        "reason": "missing_staging_row:rollout-6/call-2"}],
        "staging_keys": [f"rollout-{i}/call-0" for i in range(8)],
        "metrics": {"finalize/valid_rows": 6.0, "group_stats/reward_mean": 0.4375},
        "first_input_timestamp_ms": 1_764_410_000_000, "last_input_timestamp_ms": 1_764_410_004_500,
        "finalized_at_ms": 1_764_410_030_000,
    }


def ledger_entry() -> dict:
    return {"group_id": GROUP_ID, "partition": 3, "max_receipt_offset": 1_204,
            "max_staged_offset": -1, "outcome": "complete", "published_at_ms": 1_764_410_030_001,
            "output_digest": DIGEST, "max_route_offset": 5_310}


# (schema, case id, builder): every schema at least once, optional parts both ways.
SAMPLES = [
    ("PackedTensor", "f32", packed_tensor),
    ("StagedCall", "plain-512", lambda: staged_call_record(512)),
    ("StagedCall", "compact-512", lambda: staged_call_record(512, compact=True)),
    ("StagedCall", "routes-512x48x8", lambda: staged_call_record(512, routes=(48, 8))),
    ("StagedCall", "full", staged_call_full),
    ("ReceiptEvent", "32-calls", lambda: receipt_event_record(32)),
    ("ReceiptEvent", "missing-receipt", receipt_missing),
    ("CanonicalRow", "valid", canonical_row),
    ("CanonicalRow", "placeholder", lambda: canonical_row(valid=False)),
    ("RoutePlan", "two-spans", route_plan),
    ("GroupSummary", "deadline", group_summary),
    ("LedgerEntry", "complete", ledger_entry),
]


def expected(name: str, record: dict) -> dict:
    """``record`` with omitted defaulted fields filled in (nested records included)."""
    return _fill(json.loads(schema_json(name)), record, {})


def _fill(node, value, named):
    if isinstance(node, str):
        node = named.get(node.rpartition(".")[2], node)
    if isinstance(node, list):
        if value is None:
            return None
        records = [b for b in (named.get(x, x) if isinstance(x, str) else x for x in node)
                   if isinstance(b, dict) and b.get("type") == "record"]
        return _fill(records[0], value, named) if records and isinstance(value, dict) else value
    if isinstance(node, dict):
        if "name" in node:
            named[node["name"]] = node
        kind = node["type"]
        if kind == "record":
            return {f["name"]: _fill(f["type"], value[f["name"]], named) if f["name"] in value
                    else f["default"] for f in node["fields"]}
        if kind == "array":
            return [_fill(node["items"], v, named) for v in value]
        if kind == "map":
            return {k: _fill(node["values"], v, named) for k, v in value.items()}
        if isinstance(kind, (dict, list)):
            return _fill(kind, value, named)
    return value
