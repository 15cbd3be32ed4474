"""A FinalizedGroup -> the Avro records it publishes (rows, plans, summary, ledger entry).

Pure functions: the publisher decides where and how they are produced.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from stage.buffer import Position
from stage.finalize import CanonicalRow, FinalizedGroup
from stage.wire import pack_tensor

COMPLETE, DEADLINE, DROPPED = "complete", "deadline", "dropped"


@dataclass(frozen=True)
class GroupContext:
    """What the runtime knows about a group beyond the finalizer's result."""

    group_id: str
    partition: int
    group_size: int
    prompt_idx: int
    outcome: str                      # complete | deadline (dropped is derived from the result)
    first_timestamp_ms: int
    last_timestamp_ms: int
    max_offsets: dict                 # topic -> highest input offset of the group
    staged_positions: dict            # staging_key -> Position of its StagedCall record


def row_record(row: CanonicalRow) -> dict:
    def optional(value):
        return None if value is None else pack_tensor(value)

    media = row.media or {}
    return {
        "group_id": row.group_id, "sample_id": row.sample_id, "row_index": row.row_index,
        "group_size": row.group_size, "prompt_idx": row.prompt_idx, "rollout_id": row.rollout_id,
        "weight_version": row.weight_version, "group_max_wv": row.group_max_wv, "valid": row.valid,
        "rejection_reason": row.rejection_reason, "input_ids": pack_tensor(row.input_ids),
        "input_lengths": row.input_lengths, "generation_logprobs": pack_tensor(row.generation_logprobs),
        "token_mask": pack_tensor(row.token_mask), "sample_mask": row.sample_mask,
        "prompt_ids_for_adv": pack_tensor(row.prompt_ids_for_adv), "total_reward": row.total_reward,
        "mask_sample": row.mask_sample, "truncated": row.truncated,
        "routed_experts": optional(row.routed_experts),
        "generation_topk_ids": optional(row.generation_topk_ids),
        "generation_topk_logprobs": optional(row.generation_topk_logprobs),
        "pixel_values": optional(media.get("pixel_values")),
        "imgs_sizes": optional(media.get("imgs_sizes")),
        "num_frames": optional(media.get("num_frames")),
    }


def plan_record(row: CanonicalRow, staged_positions: dict) -> dict:
    plan = row.route_plan
    spans = []
    for span in plan.spans:
        pos: Position | None = staged_positions.get(span.staging_key)
        fragment = None
        if span.staged_route_len > 0 and pos is not None:
            fragment = {"topic": pos.topic, "partition": pos.partition, "offset": pos.offset}
        spans.append({
            "staging_key": span.staging_key, "carry_len": span.carry_len,
            "generation_len": span.generation_len, "staged_route_len": span.staged_route_len,
            "extras_digest_version": span.extras_digest_version, "extras_digest": span.extras_digest,
            "boundary_token_index": span.boundary_token_index,
            "repair_previous_token": span.repair_previous_token, "fragment": fragment})
    return {"group_id": row.group_id, "sample_id": row.sample_id, "row_index": row.row_index,
            "schema_version": plan.schema_version, "staging_partition": plan.staging_partition,
            "spans": spans, "cleanup_staging_keys": list(plan.cleanup_staging_keys),
            "expected_token_length": plan.expected_token_length}


def summary_record(group: FinalizedGroup, ctx: GroupContext, finalized_at_ms: int) -> dict:
    return {
        "group_id": ctx.group_id, "group_size": ctx.group_size, "prompt_idx": ctx.prompt_idx,
        "outcome": DROPPED if group.dropped else ctx.outcome,
        "valid_rows": group.valid_row_count, "total_rows": group.total_row_count,
        "group_min_wv": group.group_min_wv, "group_max_wv": group.group_max_wv,
        "drop_reason": group.drop_reason, "canonical_output_tokens": group.canonical_output_tokens,
        "rejections": [{"row_index": index, "rollout_id": rollout_id, "reason": reason}
                       for index, rollout_id, reason in group.rejections],
        "staging_keys": list(group.cleanup_staging_keys),
        "metrics": {k: float(v) for k, v in group.metrics.items()},
        "first_input_timestamp_ms": ctx.first_timestamp_ms,
        "last_input_timestamp_ms": ctx.last_timestamp_ms, "finalized_at_ms": finalized_at_ms,
    }


def ledger_record(ctx: GroupContext, outcome: str, receipts_topic: str, staged_topic: str,
                  published_at_ms: int, output_digest: str) -> dict:
    return {"group_id": ctx.group_id, "partition": ctx.partition,
            "max_receipt_offset": ctx.max_offsets.get(receipts_topic, -1),
            "max_staged_offset": ctx.max_offsets.get(staged_topic, -1),
            "outcome": outcome, "published_at_ms": published_at_ms, "output_digest": output_digest}


def output_digest(encoded_rows: list[bytes]) -> str:
    """SHA-256 over the encoded row records, in row order (detects a republication that differs)."""
    h = hashlib.sha256()
    for blob in encoded_rows:
        h.update(len(blob).to_bytes(8, "big"))
        h.update(blob)
    return h.hexdigest()
