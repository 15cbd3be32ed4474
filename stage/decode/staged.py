"""StagedCall (Avro dict) -> StagedItem at intake, -> StagedRow at finalization.

Intake (poll thread) only checks what the buffer needs: ids and declared sizes. The full
conversion (tensor layouts, Gym's model rules, the call digest) runs when finalization fetches
the row, off the poll thread; a row that fails it rejects its rollout as invalid_staging_row,
as a failed staged-row read does in NeMo RL.
"""

from __future__ import annotations

import operator

import numpy as np

from stage.buffer import Position, StagedItem
from stage.contract import StagedCallBaseSnapshot
from stage.decode.errors import DecodeError
from stage.decode.limits import InputLimits
from stage.decode.receipts import _identifier
from stage.finalize import StagedMedia, StagedRow, TopK
from stage.routes import ROUTE_ENCODING_ENVELOPE, ROUTE_ENCODING_LIST, ROUTE_ENCODING_NONE
from stage.wire import schema, unpack_tensor

_TOKEN_DTYPES = ("uint32", "uint64", "int32", "int64")
_FLOAT_DTYPES = ("float32", "float64")
_ROUTE_DTYPES = ("int8", "int16", "int32")
_PIXEL_DTYPES = ("float16", "float32", "bfloat16")
_SNAPSHOT_FIELDS = ("schema_version", "digest_version", "extras_digest_version", "rollout_id",
                    "model_call_id", "parent_call_id", "mode", "prev_len", "delta_len", "cum_len",
                    "weight_version", "digest", "extras_digest", "chain_hash", "cumulative_hash")


def staged_item(record: dict, position: Position, nbytes: int,
                limits: InputLimits = InputLimits()) -> StagedItem:
    group_id = _identifier(record.get("group_id"), "group_id", limits)
    key = _identifier(record.get("staging_key"), "staging_key", limits)
    delta = record.get("delta_len")
    if not isinstance(delta, int) or not 0 < delta <= limits.max_delta_tokens:
        raise DecodeError(f"must be in 1..{limits.max_delta_tokens}, got {delta!r}", field="delta_len")
    return StagedItem(group_id=group_id, staging_key=key, payload=record, position=position,
                      nbytes=nbytes, fingerprint=staged_fingerprint(record))


# Tensor columns a digest the record carries stands for (``digest``: the token columns,
# ``extras_digest``: the routes): a second copy is compared through the digests, not byte by byte.
_DIGESTED_COLUMNS = frozenset(("token_ids_delta", "token_mask_delta", "generation_log_probs_delta",
                               "routed_experts", "routed_experts_boundary"))
FINGERPRINT_FIELDS = tuple(f["name"] for f in schema("StagedCall")["fields"]
                           if f["name"] not in _DIGESTED_COLUMNS)
_fingerprint_values = operator.itemgetter(*FINGERPRINT_FIELDS)


def staged_fingerprint(record: dict) -> tuple:
    """(field names, values) of every StagedCall field but the digested columns: references,
    no copy (media and top-k, which no digest covers, are compared by value if a copy ever
    arrives). One C-level itemgetter: this runs for every staged record at intake."""
    try:
        return FINGERPRINT_FIELDS, _fingerprint_values(record)
    except KeyError:   # a hand-built record without its defaulted fields
        return FINGERPRINT_FIELDS, tuple(record.get(name) for name in FINGERPRINT_FIELDS)


def _column(record: dict, name: str, dtypes, length: int) -> np.ndarray:
    array = unpack_tensor(record[name], expect_dtypes=dtypes, expect_ndim=1, field=name)
    if array.shape[0] != length:
        raise ValueError(f"{name}: {array.shape[0]} values for delta_len {length}")
    return array


def staged_row(record: dict, limits: InputLimits = InputLimits()) -> StagedRow:
    """Full conversion; ValueError (wire layout or Gym model rules) rejects the rollout."""
    delta = record["delta_len"]
    ids = _column(record, "token_ids_delta", _TOKEN_DTYPES, delta)
    if ids.dtype.kind == "i" and ids.size and int(ids.min()) < 0:
        raise ValueError("token_ids_delta must be non-negative")
    mask = _column(record, "token_mask_delta", _FLOAT_DTYPES, delta)
    logprobs = _column(record, "generation_log_probs_delta", _FLOAT_DTYPES, delta)
    snapshot = StagedCallBaseSnapshot(
        **{name: record[name] for name in _SNAPSHOT_FIELDS},
        token_ids_delta=ids.astype(np.uint64), token_mask_delta=mask.astype(np.float64),
        generation_log_probs_delta=logprobs.astype(np.float64))
    encoding = record.get("route_encoding", ROUTE_ENCODING_NONE)
    if encoding not in (ROUTE_ENCODING_NONE, ROUTE_ENCODING_ENVELOPE, ROUTE_ENCODING_LIST):
        raise ValueError(f"unknown route encoding {encoding!r}")
    routes = boundary = None
    if record.get("routed_experts") is not None:
        routes = unpack_tensor(record["routed_experts"], expect_dtypes=_ROUTE_DTYPES, expect_ndim=3,
                               max_bytes=limits.max_route_values * 4, field="routed_experts")
        if routes.shape[0] != delta:
            raise ValueError(f"routed_experts must already be delta-aligned: got shape "
                             f"{tuple(routes.shape)} for delta_len={delta}")
    if record.get("routed_experts_boundary") is not None:
        boundary = unpack_tensor(record["routed_experts_boundary"], expect_dtypes=_ROUTE_DTYPES,
                                 expect_ndim=3, field="routed_experts_boundary")
        if boundary.shape[0] != 1:
            raise ValueError(f"routed_experts_boundary must be one token row, got {tuple(boundary.shape)}")
    return StagedRow(
        snapshot=snapshot, route_encoding=encoding if routes is not None else ROUTE_ENCODING_NONE,
        routes=routes, boundary_routes=boundary,
        extras_metadata_json=record.get("extras_metadata_json", "null").encode("utf-8"),
        media=_media(record.get("media"), limits), topk=_topk(record.get("topk"), limits))


def _media(obj, limits: InputLimits) -> StagedMedia | None:
    if obj is None:
        return None
    imgs = unpack_tensor(obj["imgs"], expect_dtypes=_PIXEL_DTYPES, expect_ndim=3,
                         max_bytes=limits.max_media_bytes, field="media.imgs")
    sizes = unpack_tensor(obj["imgs_sizes"], expect_dtypes=("int32",), expect_ndim=2,
                          field="media.imgs_sizes")
    frames = None if obj.get("num_frames") is None else unpack_tensor(
        obj["num_frames"], expect_dtypes=("int32",), expect_ndim=1, field="media.num_frames")
    return StagedMedia(imgs=imgs, imgs_sizes=sizes, num_frames=frames,
                       bfloat16=obj["imgs"]["dtype"] == "bfloat16")


def _topk(obj, limits: InputLimits) -> TopK | None:
    if obj is None:
        return None
    ids = unpack_tensor(obj["ids"], expect_dtypes=("int32",), expect_ndim=2, field="topk.ids")
    lps = unpack_tensor(obj["logprobs"], expect_dtypes=("float32",), expect_ndim=2, field="topk.logprobs")
    if ids.shape[1] > limits.max_topk:
        raise ValueError(f"topk width {ids.shape[1]} exceeds {limits.max_topk}")
    return TopK(ids=ids, logprobs=lps)
