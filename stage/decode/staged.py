"""StagedCall (Avro dict) -> StagedItem at intake, -> StagedRow at finalization.

Intake (poll thread) only checks what the buffer needs: ids and declared sizes. The full
conversion (tensor layouts, Gym's model rules, the call digest) runs when finalization fetches
the row, off the poll thread; a row that fails it rejects its rollout as invalid_staging_row,
as a failed staged-row read does in NeMo RL.

A stage that never reads route payloads (deferred router replay: the policy fetches fragments
by their Kafka coordinates; router replay off) releases them at intake (``keep_routes=False``):
the route tensors' checks run there and what finalization needs of them (the fragment's row
count, or the check's error) stays in a ``ReleasedRoutes``; the bytes go. Finalization then
sees exactly what it would have seen, in the same order, without the payload.

A call whose routes were staged by reference (``routes_ref``: chunks on the route topic,
stage.staging.route_refs) holds no route bytes at all: its reference is checked completely at
finalization (``route_reference``: limits, shape against delta_len, the configured route
topic, the record's own partition) and kept in ``StagedRow.route_ref``; no chunk is read here.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from stage.buffer import Position, StagedItem
from stage.contract import StagedCallBaseSnapshot
from stage.decode.errors import DecodeError
from stage.decode.limits import InputLimits
from stage.decode.receipts import _identifier
from stage.staging import StagedMedia, StagedRow, TopK
from stage.routes import ROUTE_ENCODING_ENVELOPE, ROUTE_ENCODING_LIST, ROUTE_ENCODING_NONE
from stage.staging.route_refs import RouteReference, RouteReferenceError
from stage.wire import schema, unpack_tensor

_TOKEN_DTYPES = ("uint32", "uint64", "int32", "int64")
_FLOAT_DTYPES = ("float32", "float64")
_ROUTE_DTYPES = ("int8", "int16", "int32")
_PIXEL_DTYPES = ("float16", "float32", "bfloat16")
_ROUTE_FIELDS = ("routed_experts", "routed_experts_boundary")
RELEASED_ROUTES = "released_routes"   # the key a released record keeps its ReleasedRoutes under
# Python objects of a decoded StagedCall beyond its tensor bytes (dicts, ids, digests, shapes):
# ~3.1 kB measured with tracemalloc (tests/decode/test_staged_routes.py keeps it honest).
DECODED_OVERHEAD_BYTES = 3_200
_SNAPSHOT_FIELDS = ("schema_version", "digest_version", "extras_digest_version", "rollout_id",
                    "model_call_id", "parent_call_id", "mode", "prev_len", "delta_len", "cum_len",
                    "weight_version", "digest", "extras_digest", "chain_hash", "cumulative_hash")


@dataclass(frozen=True)
class ReleasedRoutes:
    """What is left of a record's route tensors once their bytes are released."""

    routed_len: int           # rows of the fragment (0: the call staged none)
    error: str | None = None  # the route checks' error text, raised again at finalization


def staged_item(record: dict, position: Position, nbytes: int,
                limits: InputLimits = InputLimits(), *, keep_routes: bool = True) -> StagedItem:
    """``nbytes`` is the record's size on the wire; the item counts what it holds: that, less
    any released route bytes, plus the decoded objects' overhead."""
    group_id = _identifier(record.get("group_id"), "group_id", limits)
    key = _identifier(record.get("staging_key"), "staging_key", limits)
    delta = record.get("delta_len")
    if not isinstance(delta, int) or not 0 < delta <= limits.max_delta_tokens:
        raise DecodeError(f"must be in 1..{limits.max_delta_tokens}, got {delta!r}", field="delta_len")
    held = nbytes + DECODED_OVERHEAD_BYTES
    if not keep_routes:
        held -= release_routes(record, limits)
    return StagedItem(group_id=group_id, staging_key=key, payload=record, position=position,
                      nbytes=held, fingerprint=staged_fingerprint(record))


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


def release_routes(record: dict, limits: InputLimits = InputLimits()) -> int:
    """Check the route tensors now, keep the outcome, drop their bytes; returns bytes freed."""
    present = [name for name in _ROUTE_FIELDS if record.get(name) is not None]
    if not present:
        return 0
    if record.get("routes_ref") is not None:
        # By reference: the boundary (one token row) stays for the plan; inline routes next
        # to a reference are refused at finalization, and their bytes go now.
        if record.get("routed_experts") is None:
            return 0
        freed = _data_size(record["routed_experts"])
        record["routed_experts"] = None
        record[RELEASED_ROUTES] = ReleasedRoutes(0, _BOTH_ROUTES)
        return freed
    freed = sum(_data_size(record[name]) for name in present)
    try:
        routes, _boundary = _route_tensors(record, limits)
        released = ReleasedRoutes(0 if routes is None else int(routes.shape[0]))
    except ValueError as error:   # WireError included: the text is what a rejection names
        released = ReleasedRoutes(0, str(error))
    for name in present:
        record[name] = None
    record[RELEASED_ROUTES] = released
    return freed


_BOTH_ROUTES = "routes_ref: a staged call carries its routes inline (routed_experts) and by reference both"


def _data_size(tensor) -> int:
    data = tensor.get("data") if isinstance(tensor, dict) else None
    return len(data) if isinstance(data, (bytes, bytearray)) else 0


def _column(record: dict, name: str, dtypes, length: int) -> np.ndarray:
    array = unpack_tensor(record[name], expect_dtypes=dtypes, expect_ndim=1, field=name)
    if array.shape[0] != length:
        raise ValueError(f"{name}: {array.shape[0]} values for delta_len {length}")
    return array


def staged_row(record: dict, limits: InputLimits = InputLimits(), *,
               partition: int | None = None) -> StagedRow:
    """Full conversion; ValueError (wire layout or Gym model rules) rejects the rollout.
    ``partition``: the record's own (a route reference must name it; None: not checked)."""
    ids, mask, logprobs = staged_columns(record)
    snapshot = StagedCallBaseSnapshot(
        **{name: record[name] for name in _SNAPSHOT_FIELDS},
        token_ids_delta=ids, token_mask_delta=mask, generation_log_probs_delta=logprobs)
    return staged_row_of(record, snapshot, limits, partition=partition)


def staged_columns(record: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The token columns as Gym's types (uint64 ids, float64 masks and log-probs), checked."""
    delta = record["delta_len"]
    ids = _column(record, "token_ids_delta", _TOKEN_DTYPES, delta)
    if ids.dtype.kind == "i" and ids.size and int(ids.min()) < 0:
        raise ValueError("token_ids_delta must be non-negative")
    mask = _column(record, "token_mask_delta", _FLOAT_DTYPES, delta)
    logprobs = _column(record, "generation_log_probs_delta", _FLOAT_DTYPES, delta)
    return ids.astype(np.uint64), mask.astype(np.float64), logprobs.astype(np.float64)


def staged_row_of(record: dict, snapshot: StagedCallBaseSnapshot, limits: InputLimits, *,
                  partition: int | None = None) -> StagedRow:
    """What follows the snapshot: route encoding, reference and tensors, media, top-k (in this
    order)."""
    encoding = record.get("route_encoding", ROUTE_ENCODING_NONE)
    if encoding not in (ROUTE_ENCODING_NONE, ROUTE_ENCODING_ENVELOPE, ROUTE_ENCODING_LIST):
        raise ValueError(f"unknown route encoding {encoding!r}")
    released = record.get(RELEASED_ROUTES)
    reference = None
    if released is not None:   # checked at intake, in this same order: its outcome only
        if released.error is not None:
            raise ValueError(released.error)
        routes = boundary = None
        routed = released.routed_len
    else:
        reference = route_reference(record, limits, partition=partition)
        routes, boundary = _route_tensors(record, limits)
        routed = reference.shape[0] if reference is not None else \
            None if routes is None else int(routes.shape[0])
    return StagedRow(
        snapshot=snapshot, route_encoding=encoding if routed else ROUTE_ENCODING_NONE,
        routes=routes, boundary_routes=boundary, released_route_len=None if released is None else routed,
        route_ref=reference,
        extras_metadata_json=record.get("extras_metadata_json", "null").encode("utf-8"),
        media=_media(record.get("media"), limits), topk=_topk(record.get("topk"), limits))


def route_reference(record: dict, limits: InputLimits = InputLimits(), *,
                    partition: int | None = None) -> RouteReference | None:
    """The call's ``routes_ref``, checked completely (nothing is allocated for it, no chunk is
    read), or None when its routes are inline or absent. ValueError, naming the first problem,
    for: routes inline and by reference both, a reference under route encoding 0, a reference
    that fails RouteReference.from_value (chunk lengths within ``limits.max_route_chunk_bytes``,
    shape [delta_len, L, K]), more than ``limits.max_route_values`` values, a topic other than
    ``limits.route_topic``, a partition other than ``partition`` (the record's own: a call's
    chunks are keyed by its group id, as the call is)."""
    value = record.get("routes_ref")
    if value is None:
        return None
    if record.get("routed_experts") is not None:
        raise ValueError(_BOTH_ROUTES)
    if record.get("route_encoding", ROUTE_ENCODING_NONE) == ROUTE_ENCODING_NONE:
        raise ValueError("routes_ref: a route reference with route_encoding 0 (no routes)")
    try:
        reference = RouteReference.from_value(value, max_chunk_bytes=limits.max_route_chunk_bytes,
                                              delta_len=record.get("delta_len"))
    except RouteReferenceError as error:
        raise ValueError(f"routes_ref: {error}") from None
    t, layers, topk = reference.shape
    if t * layers * topk > limits.max_route_values:
        raise ValueError(f"routes_ref: {t * layers * topk} route values exceed {limits.max_route_values}")
    if reference.topic != limits.route_topic:
        raise ValueError(f"routes_ref: names topic {reference.topic!r}, the route topic is {limits.route_topic!r}")
    if partition is not None and reference.partition != partition:
        raise ValueError(f"routes_ref: names partition {reference.partition}, the staged call is in "
                         f"partition {partition} (a call's chunks are keyed by its group id)")
    return reference


def staged_route_fragment(record: dict, limits: InputLimits = InputLimits()):
    """(staging key, RouteFragment or None) of a decoded StagedCall, for a reader that replays
    routes only: identity, route encoding and the route tensors' layout are checked (ValueError);
    the token columns are not re-verified (the stage verified this very record before it named
    its coordinates in a plan), and the fragment's integrity is its extras digest, which the
    route executor checks against the plan. The tensors are views of the record's bytes."""
    from stage.routes.fragment import RouteFragment, readonly_tensor
    rollout_id, call_id = record.get("rollout_id"), record.get("model_call_id")
    if not (isinstance(rollout_id, str) and rollout_id and isinstance(call_id, str) and call_id):
        raise ValueError("staged call without rollout_id and model_call_id")
    key = f"{rollout_id}/{call_id}"
    encoding = record.get("route_encoding", ROUTE_ENCODING_NONE)
    if encoding not in (ROUTE_ENCODING_NONE, ROUTE_ENCODING_ENVELOPE, ROUTE_ENCODING_LIST):
        raise ValueError(f"unknown route encoding {encoding!r}")
    routes, boundary = _route_tensors(record, limits)
    if routes is None or encoding == ROUTE_ENCODING_NONE:
        return key, None
    return key, RouteFragment(
        routes=readonly_tensor(routes), encoding=encoding,
        extras_metadata_json=record.get("extras_metadata_json", "null").encode("utf-8"),
        boundary_routes=None if boundary is None else readonly_tensor(boundary))


def _route_tensors(record: dict, limits: InputLimits):
    """The route fragment [delta_len, L, K] and boundary [1, L, K] views, or ValueError."""
    delta = record["delta_len"]
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
    return routes, boundary


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
