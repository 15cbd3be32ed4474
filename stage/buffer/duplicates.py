"""A second record under an identity the buffer already holds: a duplicate, or a conflict.

A receipt's identity is its group and ``rollout_index``; a staged call's, its group and
``staging_key``. A copy with the same content is a duplicate (a producer retry, a replay):
skipped and counted. A copy with other content is a conflict: the first copy stays, the second
is dead-lettered with the text these functions return (what differs, both values) and counted.
They run only when a second record with a held identity arrives, never on the first.

"Same content" (docs/schemas.md, Duplicates and conflicts): for a receipt, every field of the
ReceiptEvent (the group-level fields are compared before, by stage.buffer.fields); for a staged
call, its ``fingerprint`` taken at decode (every field of the StagedCall but the token and route
tensors, the media and top-k columns by value), then the token and route tensors byte for byte
where both copies still hold them: a copy whose tokens changed under the same digest is a
conflict too (its digest no longer matches it). A route payload the buffer released at intake
(deferred router replay, router replay off) is compared through ``extras_digest`` only. A first
copy spilled to disk is compared through the digests it kept (stage.buffer.digests), with the
same outcome as in memory.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from stage.buffer.digests import TensorDigest, ValueDigest, spilled_fingerprint, value_digest
from stage.buffer.items import ReceiptItem, StagedItem

_SHOWN = 80   # characters of a differing value quoted in the conflict text


def _same(a: Any, b: Any) -> bool:
    """Structural equality in which NaN equals NaN (a replayed receipt may carry one in a
    field nothing checks, such as the receipt's own ``reward``)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    """The path of the first place ``a`` and ``b`` differ, with both values (None: the same)."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return next((d for k in a if (d := _first_difference(a[k], b[k], f"{path}.{k}"))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b))
                     if (d := _first_difference(x, y, f"{path}[{i}]"))), None)
    if _same(a, b):
        return None
    return f"{path} {_show(b)} != {_show(a)}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _where(item) -> str:
    pos = item.position
    return f"{pos.topic}[{pos.partition}]@{pos.offset}"


def receipt_difference(first: ReceiptItem, second: ReceiptItem) -> str | None:
    """Why ``second`` (same group and rollout_index as ``first``) is a conflict, or None."""
    fields = (("rollout_id", first.rollout_id, second.rollout_id),
              ("reward", first.reward, second.reward),
              ("mask_sample", first.mask_sample, second.mask_sample),
              ("canonical_sample_id", first.canonical_sample_id, second.canonical_sample_id),
              ("labels", sorted(set(first.labels)), sorted(set(second.labels))),
              ("result_stats", sorted(first.result_stats), sorted(second.result_stats)),
              ("receipt", first.receipt, second.receipt))
    for name, ours, theirs in fields:
        detail = _first_difference(ours, theirs, name)
        if detail:
            return (f"conflicts with group {second.group_id}: rollout_index {second.rollout_index} "
                    f"received twice with different content: {detail} (the new copy's value "
                    f"first; the first copy, kept, at {_where(first)})")
    return None


def _fields(fingerprint: tuple) -> dict:
    names, values = fingerprint or ((), ())
    return dict(zip(names, values))


# The tensor columns a StagedCall's digests stand for, compared byte for byte when both copies
# hold them (routes are None once released at intake).
TENSOR_COLUMNS = ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta",
                  "routed_experts", "routed_experts_boundary")


def keep_digests(item: StagedItem) -> None:
    """What ``item`` keeps for this check once its payload leaves memory (spilled): its
    fingerprint's large values and its tensors as digests."""
    item.fingerprint = spilled_fingerprint(item.fingerprint)
    payload = item.payload if isinstance(item.payload, dict) else {}
    item.tensors = {name: None if payload.get(name) is None else TensorDigest.of(payload[name])
                    for name in TENSOR_COLUMNS}


def _tensor_difference(first: StagedItem, second: StagedItem) -> str | None:
    ours = first.tensors if first.spilled else first.payload
    theirs = second.tensors if second.spilled else second.payload
    if not isinstance(ours, dict) or not isinstance(theirs, dict):
        return None
    for name in TENSOR_COLUMNS:
        a, b = ours.get(name), theirs.get(name)
        if a is None and b is None:
            continue
        if a is None or b is None:
            if name.startswith("routed_experts"):
                continue   # one copy's payload released at intake: extras_digest stands for it
            return f"{name} present in one copy only"
        if not _same_tensor(a, b):
            return f"{name} differs (same digest: the new copy's tensor does not match it)"
    return None


def _same_tensor(a, b) -> bool:
    """Equal values and shape (a column sent as uint32 in one copy and uint64 in the other is
    the same column); a NaN equals a NaN. A spilled copy's side is its digest."""
    if isinstance(b, (TensorDigest, ValueDigest)):
        a, b = b, a
    if isinstance(a, TensorDigest):
        return a.matches(b)
    if isinstance(a, ValueDigest):
        return a == value_digest(b)
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return _same(a, b)
    if a.get("shape") != b.get("shape"):
        return False
    if a.get("dtype") == b.get("dtype"):
        return a.get("data") == b.get("data")
    try:
        x = np.frombuffer(a["data"], dtype=np.dtype(a["dtype"]))
        y = np.frombuffer(b["data"], dtype=np.dtype(b["dtype"]))
    except (TypeError, ValueError, KeyError):   # a dtype numpy does not know: compare as sent
        return False
    floats = x.dtype.kind == "f" or y.dtype.kind == "f"
    return x.shape == y.shape and bool(np.array_equal(x, y, equal_nan=floats))


def _same_field(a: Any, b: Any) -> bool:
    """``_same``, where a spilled copy's large values are digests (stage.buffer.digests)."""
    if isinstance(a, ValueDigest) or isinstance(b, ValueDigest):
        return value_digest(a) == value_digest(b)
    return _same(a, b)


def _bulky(value: Any) -> bool:
    return isinstance(value, dict)   # a spilled copy's digest is quoted as one


def staged_difference(first: StagedItem, second: StagedItem) -> str | None:
    """Why ``second`` (same group and staging_key as ``first``) is a conflict, or None."""
    ours, theirs = _fields(first.fingerprint), _fields(second.fingerprint)
    detail = None
    for name in dict.fromkeys([*ours, *theirs]):
        a, b = ours.get(name), theirs.get(name)
        if not _same_field(a, b):
            detail = (f"{name} {_show(b)} != {_show(a)}" if not _bulky(a) and not _bulky(b)
                      else f"{name} differs")   # media, top-k: tensors, not worth quoting
            break
    detail = detail or _tensor_difference(first, second)
    if detail is None:
        return None
    return (f"conflicts with group {second.group_id}: staging_key {second.staging_key!r} "
            f"staged twice with different content: {detail} (the new copy's value first; "
            f"the first copy, kept, at {_where(first)})")
