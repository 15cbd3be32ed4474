"""A FinalizedGroup -> the Avro records it publishes (rows, plans, summary, ledger entry).

Pure functions: the publisher decides where and how they are produced. ``encode_row`` splits
a row larger than the codec's max_record_bytes into ``row_part`` records (docs/schemas.md).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from stage.buffer import Position
from stage.finalize import CanonicalRow, FinalizedGroup
from stage.wire import INPUT_LEDGER_FIELDS, WireError, pack_tensor

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
    # staging_key -> RoutePlanChunks value, for calls whose routes were staged by reference
    route_chunks: dict = field(default_factory=dict)


def row_record(row: CanonicalRow, *, views: bool = False) -> dict:
    """The CanonicalRow record of ``row``. ``views``: its tensors' ``data`` are byte views of
    the row's arrays, not copies (encode_row, which encodes the record at once: AvroCodec.encode
    splices large views in, so a direct-mode row's routes are copied once, not four times)."""
    def packed(value):
        return pack_tensor(value, copy=not views)

    def optional(value):
        return None if value is None else packed(value)

    media = row.media or {}
    return {
        "group_id": row.group_id, "sample_id": row.sample_id, "row_index": row.row_index,
        "group_size": row.group_size, "prompt_idx": row.prompt_idx, "rollout_id": row.rollout_id,
        "weight_version": row.weight_version, "group_max_wv": row.group_max_wv, "valid": row.valid,
        "rejection_reason": row.rejection_reason, "input_ids": packed(row.input_ids),
        "input_lengths": row.input_lengths, "generation_logprobs": packed(row.generation_logprobs),
        "token_mask": packed(row.token_mask), "sample_mask": row.sample_mask,
        "prompt_ids_for_adv": packed(row.prompt_ids_for_adv), "total_reward": row.total_reward,
        "mask_sample": row.mask_sample, "truncated": row.truncated,
        "routed_experts": optional(row.routed_experts),
        "generation_topk_ids": optional(row.generation_topk_ids),
        "generation_topk_logprobs": optional(row.generation_topk_logprobs),
        "pixel_values": optional(media.get("pixel_values")),
        "imgs_sizes": optional(media.get("imgs_sizes")),
        "num_frames": optional(media.get("num_frames")),
        "row_part": None,   # the whole row; encode_row splits one over the record cap
    }


# Every PackedTensor field of CanonicalRow: a split row slices each along dimension 0.
ROW_TENSOR_FIELDS = ("input_ids", "generation_logprobs", "token_mask", "prompt_ids_for_adv",
                     "routed_experts", "generation_topk_ids", "generation_topk_logprobs",
                     "pixel_values", "imgs_sizes", "num_frames")
# Parts of one row at most (parts of the default 8,000,000-byte cap: 32 GB; of 960 KiB, a 1 MiB
# broker's: 3.8 GiB; far past any rollout a group buffers).
MAX_ROW_PARTS = 4096
_VARINT_SLACK = 10   # the most a length or count prefix can grow by


class RowTooLarge(ValueError):
    """A row that cannot be published even split into parts."""


def _slice(tensor: dict, start: int, stop: int) -> dict:
    """Rows start:stop along dimension 0 of a packed tensor (C order: a byte range)."""
    shape = list(tensor["shape"])
    row_bytes = len(tensor["data"]) // shape[0] if shape[0] else 0
    return {"dtype": tensor["dtype"], "shape": [stop - start, *shape[1:]],
            "data": tensor["data"][start * row_bytes:stop * row_bytes]}


def encode_row(row: CanonicalRow, codec) -> list[bytes]:
    """The row's CanonicalRow record, or its ``row_part`` records when one record would be over
    ``codec.max_record_bytes``: as few parts as fit, each tensor field sliced evenly along
    dimension 0. Raises RowTooLarge when even that cannot fit (MAX_ROW_PARTS, or a cap below
    the row's fixed fields); other WireErrors propagate."""
    record = row_record(row, views=True)
    cap = codec.max_record_bytes
    tensors = {name: record[name] for name in ROW_TENSOR_FIELDS if record[name] is not None}
    payload = sum(len(t["data"]) for t in tensors.values())
    if payload <= cap:           # may fit: over the cap only when its other fields push it over
        try:
            return [codec.encode(record)]
        except WireError:
            pass                 # over the cap after all: split below (or fail there)
    empty = {**record, **{name: _slice(t, 0, 0) for name, t in tensors.items()},
             "row_part": {"index": 0, "count": 1}}
    try:
        frame = len(codec.encode(empty))
    except WireError as error:
        raise RowTooLarge(f"its fields without tensor data cannot be encoded: {error}") from None
    widest = sum(len(t["data"]) // t["shape"][0] for t in tensors.values() if t["shape"][0])
    room = cap - frame - widest - 2 * _VARINT_SLACK * (len(tensors) + 1)
    if room <= 0:
        raise RowTooLarge(f"{frame + widest} bytes of fixed fields and one row of each tensor, "
                          f"max_record_bytes={cap}")
    count = max(2, math.ceil(payload / room))
    if count > MAX_ROW_PARTS:
        raise RowTooLarge(f"{payload} tensor bytes need {count} parts of max_record_bytes={cap}, "
                          f"more than {MAX_ROW_PARTS}")
    parts = []
    for index in range(count):
        part = {**record, "row_part": {"index": index, "count": count}}
        for name, tensor in tensors.items():
            n = tensor["shape"][0]
            part[name] = _slice(tensor, n * index // count, n * (index + 1) // count)
        parts.append(codec.encode(part))
    return parts


def plan_record(row: CanonicalRow, staged_positions: dict, route_chunks: dict | None = None) -> dict:
    """The RoutePlan record of ``row``: each span with staged routes names where they are, the
    StagedCall record holding them inline (``fragment``, from ``staged_positions``) or, for a
    call staged by reference, its chunks (``chunks``, from ``route_chunks``: staging_key ->
    RoutePlanChunks value); never both."""
    plan = row.route_plan
    spans = []
    for span in plan.spans:
        pos: Position | None = staged_positions.get(span.staging_key)
        fragment = chunks = None
        if span.staged_route_len > 0:
            chunks = (route_chunks or {}).get(span.staging_key)
            if chunks is None and pos is not None:
                fragment = {"topic": pos.topic, "partition": pos.partition, "offset": pos.offset}
        spans.append({
            "staging_key": span.staging_key, "carry_len": span.carry_len,
            "generation_len": span.generation_len, "staged_route_len": span.staged_route_len,
            "extras_digest_version": span.extras_digest_version, "extras_digest": span.extras_digest,
            "boundary_token_index": span.boundary_token_index,
            "repair_previous_token": span.repair_previous_token, "fragment": fragment,
            "chunks": chunks})
    return {"group_id": row.group_id, "sample_id": row.sample_id, "row_index": row.row_index,
            "schema_version": plan.schema_version, "staging_partition": plan.staging_partition,
            "spans": spans, "cleanup_staging_keys": list(plan.cleanup_staging_keys),
            "expected_token_length": plan.expected_token_length}


# GroupSummary metrics the stage adds (not NeMo RL's): what a compacted summary left out.
STAGING_KEYS_OMITTED = "finalize/staging_keys_omitted"
REJECTION_DETAILS_OMITTED = "finalize/rejection_details_omitted"
NON_FINITE_METRICS_DROPPED = "finalize/non_finite_metrics_dropped"
SUMMARY_COMPACTIONS = 3   # compact=0 (full), 1, 2: see summary_record


def summary_record(group: FinalizedGroup, ctx: GroupContext, finalized_at_ms: int, *,
                   compact: int = 0) -> dict:
    """The GroupSummary. Every metric is finite: a non-finite one is left out and counted
    (NON_FINITE_METRICS_DROPPED). ``compact`` for a summary over the record cap (the sizes
    come from the input: N receipts' manifests and ids): 1 leaves out ``staging_keys``
    (counted in STAGING_KEYS_OMITTED), 2 also cuts each rejection to its reason's bucket and
    leaves out its rollout_id (the rows carry both)."""
    metrics = {k: float(v) for k, v in group.metrics.items() if math.isfinite(v)}
    if len(metrics) < len(group.metrics):
        metrics[NON_FINITE_METRICS_DROPPED] = float(len(group.metrics) - len(metrics))
    staging_keys = list(group.cleanup_staging_keys)
    rejections = [{"row_index": index, "rollout_id": rollout_id, "reason": reason}
                  for index, rollout_id, reason in group.rejections]
    if compact >= 1:
        metrics[STAGING_KEYS_OMITTED] = float(len(staging_keys))
        staging_keys = []
    if compact >= 2:
        metrics[REJECTION_DETAILS_OMITTED] = 1.0
        rejections = [{"row_index": r["row_index"], "rollout_id": "",
                       "reason": r["reason"].split(":", 1)[0]} for r in rejections]
    return {
        "group_id": ctx.group_id, "group_size": ctx.group_size, "prompt_idx": ctx.prompt_idx,
        "outcome": DROPPED if group.dropped else ctx.outcome,
        "valid_rows": group.valid_row_count, "total_rows": group.total_row_count,
        "group_min_wv": group.group_min_wv, "group_max_wv": group.group_max_wv,
        "drop_reason": group.drop_reason, "canonical_output_tokens": group.canonical_output_tokens,
        "rejections": rejections, "staging_keys": staging_keys, "metrics": metrics,
        "first_input_timestamp_ms": ctx.first_timestamp_ms,
        "last_input_timestamp_ms": ctx.last_timestamp_ms, "finalized_at_ms": finalized_at_ms,
    }


def ledger_record(ctx: GroupContext, outcome: str, topics, published_at_ms: int,
                  output_digest: str) -> dict:
    """``topics``: the TopicNames; each input role's highest offset goes in its ledger field."""
    offsets = {field: ctx.max_offsets.get(getattr(topics, role), -1)
               for role, field in INPUT_LEDGER_FIELDS.items()}
    return {"group_id": ctx.group_id, "partition": ctx.partition, **offsets,
            "outcome": outcome, "published_at_ms": published_at_ms, "output_digest": output_digest}


_PARALLEL_DIGEST_BYTES = 32 << 20
_digest_pool = None


def _digest_threads():
    global _digest_pool
    if _digest_pool is None:
        from concurrent.futures import ThreadPoolExecutor
        _digest_pool = ThreadPoolExecutor(2, thread_name_prefix="output-digest")
    return _digest_pool


def output_digest(encoded_rows: list[bytes]) -> str:
    """SHA-256 over each encoded row record's SHA-256, in row order (detects a republication
    that differs). Large rows (direct router replay: hundreds of MB a group) are hashed on two
    threads side by side; hashlib releases the GIL while it hashes."""
    if sum(len(blob) for blob in encoded_rows) >= _PARALLEL_DIGEST_BYTES:
        digests = list(_digest_threads().map(lambda blob: hashlib.sha256(blob).digest(), encoded_rows))
    else:
        digests = [hashlib.sha256(blob).digest() for blob in encoded_rows]
    h = hashlib.sha256()
    for digest in digests:
        h.update(digest)
    return h.hexdigest()
