"""Domain objects -> the Avro dicts of the input topics (what producers publish).

Used by the producer SDK, the Gym bridge and the tests. Token ids travel as uint32 when they
fit (vocabularies do), else uint64; masks and log-probs as float32, the width NeMo RL stages and
the digest binds (Gym hashes their float32 images).
"""

from __future__ import annotations

import numpy as np

from collections.abc import Mapping
from typing import Any

from stage.contract import RolloutReceipt, RouteEnvelope, StagedCallRecord
from stage.finalize import StagedRow, staged_row_from_record
from stage.routes import (
    ROUTE_ENCODING_ENVELOPE,
    ROUTED_EXPERTS_BOUNDARY_FIELD,
    ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD,
    ROUTED_EXPERTS_FIELD,
    encode_extras_metadata_json,
)
from stage.wire import pack_tensor

_U32_MAX = np.iinfo(np.uint32).max


def _token_tensor(ids: np.ndarray) -> dict:
    ids = np.asarray(ids, dtype=np.uint64)
    narrow = ids.size == 0 or int(ids.max()) <= _U32_MAX
    return pack_tensor(ids.astype(np.uint32) if narrow else ids)


def staged_call_value(group_id: str, row: StagedRow, *, copy_routes: bool = True) -> dict:
    """The StagedCall value of ``row``, routes inline. ``copy_routes=False``: the routes' data
    is a byte view of ``row.routes`` (for routes over immutable bytes, e.g. an envelope's),
    copied only when the record (or a route chunk) is encoded."""
    s = row.snapshot
    value = {
        "group_id": group_id, "staging_key": row.staging_key,
        "schema_version": s.schema_version, "digest_version": s.digest_version,
        "extras_digest_version": s.extras_digest_version, "rollout_id": s.rollout_id,
        "model_call_id": s.model_call_id, "parent_call_id": s.parent_call_id, "mode": s.mode,
        "prev_len": s.prev_len, "delta_len": s.delta_len, "cum_len": s.cum_len,
        "weight_version": s.weight_version, "digest": s.digest,
        "token_ids_delta": _token_tensor(s.token_ids_delta),
        "token_mask_delta": pack_tensor(np.asarray(s.token_mask_delta, dtype=np.float32)),
        "generation_log_probs_delta": pack_tensor(np.asarray(s.generation_log_probs_delta, dtype=np.float32)),
        "extras_digest": s.extras_digest, "chain_hash": s.chain_hash,
        "cumulative_hash": s.cumulative_hash, "route_encoding": row.route_encoding,
        "routed_experts": None if row.routes is None else pack_tensor(row.routes, copy=copy_routes),
        "routed_experts_boundary": None if row.boundary_routes is None else pack_tensor(row.boundary_routes),
        "extras_metadata_json": row.extras_metadata_json.decode("utf-8"),
        "media": None, "topk": None, "routes_ref": None,
    }
    if row.media is not None:
        media = row.media
        value["media"] = {
            "imgs": pack_tensor(media.pixels() if media.bfloat16 else media.imgs),
            "imgs_sizes": pack_tensor(media.imgs_sizes),
            "num_frames": None if media.num_frames is None else pack_tensor(media.num_frames)}
    if row.topk is not None:
        value["topk"] = {"ids": pack_tensor(row.topk.ids), "logprobs": pack_tensor(row.topk.logprobs)}
    return value


def staged_call_from_record(group_id: str, record: StagedCallRecord, *, media=None, topk=None) -> dict:
    """A validated Gym StagedCallRecord (with extras) -> StagedCall value."""
    return staged_call_value(group_id, staged_row_from_record(record, media=media, topk=topk))


def receipt_event(*, group_id: str, rollout_id: str, rollout_index: int, group_size: int,
                  prompt_idx: int, reward: float, receipt: RolloutReceipt | dict | None,
                  mask_sample: bool = False, loss_multiplier: float = 1.0,
                  fallback_weight_version: int = 0, canonical_sample_id: str | None = None,
                  labels=(), result_stats=()) -> dict:
    """A ReceiptEvent value; ``receipt=None`` publishes a missing-receipt event."""
    body = receipt.to_json() if isinstance(receipt, RolloutReceipt) else receipt
    return {
        "group_id": group_id, "rollout_id": rollout_id, "rollout_index": rollout_index,
        "group_size": group_size, "prompt_idx": prompt_idx, "reward": float(reward),
        "mask_sample": bool(mask_sample), "loss_multiplier": float(loss_multiplier),
        "fallback_weight_version": int(fallback_weight_version),
        "canonical_sample_id": canonical_sample_id,
        "labels": [{"scope": scope, "name": name} for scope, name in labels],
        "result_stats": [{"field": f, "sum": float(total), "count": int(count)} for f, total, count in result_stats],
        "receipt": body,
    }


def route_extras(routed_experts, *, boundary=None, boundary_index: int | None = None,
                 dtype: str = "int16", extras: Mapping[str, Any] | None = None) -> dict | None:
    """The extras a call commits to: user metadata plus the nrlre1 route envelopes."""
    parts = route_envelopes(routed_experts, boundary=boundary, boundary_index=boundary_index,
                            dtype=dtype, extras=extras)
    return None if parts is None else {
        k: v.text() if isinstance(v, RouteEnvelope) else v for k, v in parts.items()}


def route_envelopes(routed_experts, *, boundary=None, boundary_index: int | None = None,
                    dtype: str = "int16", extras: Mapping[str, Any] | None = None) -> dict | None:
    """``route_extras`` with the envelopes as ``RouteEnvelope`` parts (digested as the strings,
    never written out: staging a call with routes needs no base64 string)."""
    out = dict(extras or {})
    for name in (ROUTED_EXPERTS_FIELD, ROUTED_EXPERTS_BOUNDARY_FIELD, ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD):
        if name in out and (routed_experts is not None or boundary is not None):
            raise ValueError(f"pass routes as arrays, not as extras[{name!r}]")
    if routed_experts is not None:
        out[ROUTED_EXPERTS_FIELD] = RouteEnvelope.of(np.asarray(routed_experts), dtype=dtype)
    if boundary is not None:
        if routed_experts is None:
            raise ValueError("routed_experts_boundary needs the call's routed_experts")
        out[ROUTED_EXPERTS_BOUNDARY_FIELD] = RouteEnvelope.of(np.asarray(boundary), dtype=dtype)
        out[ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD] = int(boundary_index)
    return out or None


def envelope_array(envelope: RouteEnvelope) -> np.ndarray:
    """The envelope's values as a read-only array in its dtype (a view of its bytes)."""
    array = np.frombuffer(envelope.raw, dtype=np.dtype(envelope.dtype).newbyteorder("<"))
    return array.reshape(envelope.shape)


def staged_row_from_envelopes(snapshot, extras: dict, *, media=None, topk=None) -> StagedRow:
    """The stage's storage form of a call whose extras hold its routes as RouteEnvelope parts:
    the route tensors straight from their bytes (no envelope string decoded)."""
    routes = extras[ROUTED_EXPERTS_FIELD]
    boundary = extras.get(ROUTED_EXPERTS_BOUNDARY_FIELD)
    if routes.shape[0] != snapshot.delta_len:
        raise ValueError(f"routed_experts must already be delta-aligned: got shape "
                         f"{routes.shape} for delta_len={snapshot.delta_len}")
    if boundary is not None and boundary.shape[0] != 1:
        raise ValueError(f"routed_experts_boundary must be one token row, got {boundary.shape}")
    return StagedRow(snapshot=snapshot, route_encoding=ROUTE_ENCODING_ENVELOPE,
                     routes=envelope_array(routes),
                     boundary_routes=None if boundary is None else envelope_array(boundary),
                     extras_metadata_json=encode_extras_metadata_json(extras), media=media, topk=topk)
