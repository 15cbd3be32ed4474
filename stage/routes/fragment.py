"""Staged route fragments and their receipt-bound integrity check (spec §3.8).

The staged tensor is untrusted transport: before any of its rows reach a training row,
the extras the producer committed to are rebuilt from it and re-digested against the
receipt's ``extras_digest``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stage.contract import EXTRAS_DIGEST_VERSION, RouteEnvelope, compute_extras_digest
from stage.routes.constants import (
    ROUTE_ENCODING_ENVELOPE,
    ROUTE_ENCODING_LIST,
    ROUTED_EXPERTS_BOUNDARY_FIELD,
    ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD,
    ROUTED_EXPERTS_FIELD,
)

_ENVELOPE_DTYPES = {torch.int8: "int8", torch.int16: "int16", torch.int32: "int32"}
# Deepest nesting of arrays/objects staged metadata may have. The call digest does not cover
# this text, so a producer can stage any JSON here: json.loads raises RecursionError near 1,000
# levels, and everything that walks the parsed value afterwards (the extras digest) recurses
# too. Real extras are a few levels deep.
MAX_METADATA_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


@dataclass(frozen=True, eq=False)  # eq=False: tensor fields have no boolean equality
class RouteFragment:
    """One staged route payload plus the metadata its extras digest binds."""

    routes: torch.Tensor  # [staged_len, L, K] in the staged dtype (int8/16/32)
    encoding: int  # ROUTE_ENCODING_* the digest was committed over
    extras_metadata_json: bytes  # canonical extras minus the route keys, or b"null"
    boundary_routes: torch.Tensor | None = None  # v3 sidecar [1, L, K]


def readonly_tensor(array) -> torch.Tensor:
    """A CPU tensor over a read-only array's memory, no copy (staged route tensors are views of
    the decoded record's bytes). torch has no read-only tensors: nothing may write to it (the
    executor and the integrity check only read). numpy < 2.1 cannot export read-only memory:
    then a private copy."""
    try:
        return torch.from_dlpack(array)
    except (BufferError, TypeError, RuntimeError):
        return torch.from_numpy(array.copy())


def encode_extras_metadata_json(extras: Mapping[str, Any] | None) -> bytes:
    """Canonical staged metadata: the call's extras minus the route payloads (staged as
    tensors beside it), sorted keys, compact, UTF-8; literally ``null`` for no extras."""
    if extras is None:
        return b"null"
    rest = {
        k: v
        for k, v in extras.items()
        if k not in (ROUTED_EXPERTS_FIELD, ROUTED_EXPERTS_BOUNDARY_FIELD)
    }
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8"
    )


def json_nesting_depth(text: bytes) -> int:
    """How deep arrays and objects nest in JSON ``text`` (brackets inside strings ignored).
    Vectorised, so a long flat text costs no Python loop; an upper bound on malformed text."""
    bare = _JSON_STRING.sub(b'""', text)
    steps = _OPEN[np.frombuffer(bare, dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def parse_extras_metadata(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Staged metadata as a dict (``null`` -> ``{}``); ValueError/TypeError if malformed,
    nested deeper than ``MAX_METADATA_DEPTH`` included (checked before parsing)."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"extras_metadata_json must be bytes, got {type(raw).__name__}")
    text = bytes(raw)
    # fewer brackets than the bound cannot nest past it: the scan runs only when they could
    if text.count(b"[") + text.count(b"{") > MAX_METADATA_DEPTH and \
            (depth := json_nesting_depth(text)) > MAX_METADATA_DEPTH:
        raise ValueError(f"extras_metadata_json nests {depth} levels deep, more than {MAX_METADATA_DEPTH}")
    value = json.loads(text.decode("utf-8"))
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("extras_metadata_json must encode an object or null")
    return value


def metadata_boundary_index(metadata: Mapping[str, Any]) -> int | None:
    """The staged boundary index, validated (exact non-negative int) when present."""
    if ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD not in metadata:
        return None
    index = metadata[ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD]
    if type(index) is not int or index < 0:
        raise ValueError(f"malformed {ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD}: {index!r}")
    return index


def envelope_parts(tensor: torch.Tensor) -> RouteEnvelope:
    """The ``nrlre1`` envelope of a tensor in its own dtype (TQ/Kafka must preserve it), as
    parts: no copy of a contiguous CPU tensor, no base64 string."""
    dtype = _ENVELOPE_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"unsupported routed_experts dtype {tensor.dtype}")
    return RouteEnvelope.of(tensor.detach().cpu().numpy(), dtype)


def envelope_of(tensor: torch.Tensor) -> str:
    """``nrlre1`` envelope string of a tensor in its own dtype."""
    return envelope_parts(tensor).text()


def _route_extras(fragment: RouteFragment, envelope) -> dict[str, Any]:
    extras = dict(parse_extras_metadata(fragment.extras_metadata_json))
    routes = fragment.routes
    if not isinstance(routes, torch.Tensor):
        raise TypeError(f"fragment routes must be a tensor, got {type(routes).__name__}")
    if fragment.encoding == ROUTE_ENCODING_ENVELOPE:
        extras[ROUTED_EXPERTS_FIELD] = envelope(routes)
    elif fragment.encoding == ROUTE_ENCODING_LIST:
        extras[ROUTED_EXPERTS_FIELD] = routes.tolist()
    else:
        raise ValueError(f"unsupported route encoding {fragment.encoding!r}")
    index = metadata_boundary_index(extras)
    if index is not None:
        if fragment.boundary_routes is None:
            raise ValueError("metadata names a boundary index but no boundary route was staged")
        extras[ROUTED_EXPERTS_BOUNDARY_FIELD] = envelope(fragment.boundary_routes)
    elif fragment.boundary_routes is not None:
        raise ValueError("boundary route staged without a boundary index")
    return extras


def rebuild_route_extras(fragment: RouteFragment) -> dict[str, Any]:
    """The extras dict exactly as committed; raises ValueError/TypeError when impossible."""
    return _route_extras(fragment, envelope_of)


def verify_route_fragment_integrity(span: Any, fragment: RouteFragment) -> bool:
    """True iff the fragment rebuilds to extras whose Gym digest equals the span's
    receipt-bound commitment. Never raises: malformed input simply fails verification."""
    try:
        version = span.extras_digest_version
        if type(version) is not int or version != EXTRAS_DIGEST_VERSION:
            return False
        # the envelopes as parts: the digest streams their base64, no string is built
        return compute_extras_digest(_route_extras(fragment, envelope_parts)) == span.extras_digest
    except (TypeError, ValueError, RuntimeError, AttributeError, OverflowError):
        return False
