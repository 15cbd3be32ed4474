"""Producer-side test data: stage route fragments exactly as a capture worker would.

Digests are computed from extras built with the contract's own encoder, independently of
the code under test (which rebuilds them from the staged tensor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from stage.contract import compute_extras_digest, encode_routed_experts
from stage.routes import (
    ROUTE_ENCODING_ENVELOPE,
    ROUTE_ENCODING_LIST,
    ROUTED_EXPERTS_BOUNDARY_FIELD,
    ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD,
    ROUTED_EXPERTS_FIELD,
    RouteAssemblyPlan,
    RouteFragment,
    RouteSpan,
    encode_extras_metadata_json,
)

PARTITION = "staging"
DIGEST = "ab" * 32
L, K = 1, 2


def routes(call: int, rows: int, layers: int = L, topk: int = K) -> np.ndarray:
    """Distinct small values (fit int8) so misplaced rows are visible."""
    return (np.arange(rows * layers * topk).reshape(rows, layers, topk) + call * 30).astype(np.int64)


@dataclass
class Staged:
    fragment: RouteFragment
    digest: str
    extras: dict


def stage_call(
    values: np.ndarray,
    *,
    dtype: str = "int16",
    encoding: int = ROUTE_ENCODING_ENVELOPE,
    metadata: dict | None = None,
    boundary: np.ndarray | None = None,
    boundary_index: int | None = None,
) -> Staged:
    extras = dict(metadata or {})
    if encoding == ROUTE_ENCODING_LIST:
        extras[ROUTED_EXPERTS_FIELD] = values.tolist()
        tensor = torch.tensor(values.tolist(), dtype=torch.int16)  # lists are staged as int16
    else:
        extras[ROUTED_EXPERTS_FIELD] = encode_routed_experts(values, dtype=dtype)
        tensor = torch.from_numpy(values.astype(dtype))
    boundary_tensor = None
    if boundary is not None:
        extras[ROUTED_EXPERTS_BOUNDARY_FIELD] = encode_routed_experts(boundary, dtype=dtype)
        boundary_tensor = torch.from_numpy(boundary.astype(dtype))
    if boundary_index is not None:
        extras[ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD] = boundary_index
    fragment = RouteFragment(
        routes=tensor,
        encoding=encoding,
        extras_metadata_json=encode_extras_metadata_json(extras),
        boundary_routes=boundary_tensor,
    )
    return Staged(fragment, compute_extras_digest(extras), extras)


def span(key, carry, gen, staged, digest=DIGEST, index=None, repair=False) -> RouteSpan:
    return RouteSpan(key, carry, gen, staged, 1, digest, index, repair)


def plan(spans, *, expected=None, cleanup=None, schema=3) -> RouteAssemblyPlan:
    spans = tuple(spans)
    if expected is None:
        expected = sum(s.carry_len + s.generation_len for s in spans)
    if cleanup is None:
        cleanup = tuple(dict.fromkeys(s.staging_key for s in spans)) + ("r/off-chain",)
    return RouteAssemblyPlan(schema, PARTITION, spans, tuple(cleanup), expected)


@dataclass
class TwoTurn:
    plan: RouteAssemblyPlan
    fragments: dict[str, RouteFragment]
    expected: torch.Tensor  # int16 [7, L, K]
    boundary_route: np.ndarray


def two_turn(dtype: str = "int16", *, parent_routes: bool = True) -> TwoTurn:
    """Root c1 (carry 2, gen 2) + child c2 (carry 1, gen 2) repairing canonical row 3."""
    boundary = np.array([[[70, 71]]])
    c1 = stage_call(routes(1, 4), dtype=dtype)
    c2 = stage_call(routes(2, 3), dtype=dtype, boundary=boundary, boundary_index=3)
    p = plan(
        [
            span("r/c1", 2, 2, 4 if parent_routes else 0, c1.digest),
            span("r/c2", 1, 2, 3, c2.digest, index=3, repair=True),
        ]
    )
    first = routes(1, 4) if parent_routes else np.full((4, L, K), -1)
    expected = np.concatenate([first, routes(2, 3)])
    expected[3] = boundary[0]
    frags = {"r/c1": c1.fragment, "r/c2": c2.fragment}
    if not parent_routes:
        del frags["r/c1"]
    return TwoTurn(p, frags, torch.tensor(expected, dtype=torch.int16), boundary)


def raises_exact(exc: type[BaseException], message: str):
    """pytest.raises matching the whole message, not a substring."""
    return pytest.raises(exc, match=f"^{re.escape(message)}$")
