"""Shared route-plan executor (spec §3.6, §3.7, §3.9).

The executor never decides policy: it returns ``(tensor, None)`` or ``(None, reason)``.
Direct mode turns a reason into ``route_assembly:<reason>`` before publication; deferred
mode turns it into an all-sentinel row plus a counted fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import torch

from stage.contract import classify_route_span
from stage.routes.constants import (
    METRIC_ROUTED_EXPERTS_ROW_COVERAGE,
    METRIC_ROUTED_EXPERTS_SENTINEL_TOKEN_FRACTION,
    ROUTE_FAILURE_ASSEMBLED_LENGTH,
    ROUTE_FAILURE_BOUNDARY,
    ROUTE_FAILURE_CANONICAL_LENGTH,
    ROUTE_FAILURE_INTEGRITY,
    ROUTE_FAILURE_LENGTH,
    ROUTE_FAILURE_MISSING_FRAGMENT,
    ROUTE_FAILURE_MODEL_SHAPE,
    ROUTE_FAILURE_RANK,
    ROUTE_MISSING_SENTINEL,
    ROUTE_SPAN_FULL,
    ROUTE_SPAN_SENTINEL,
    UNKNOWN_ROUTE_DIMS_MESSAGE,
)
from stage.routes.device import resolve_device
from stage.routes.dims import RouteDimsCache
from stage.routes.fragment import (
    RouteFragment,
    metadata_boundary_index,
    parse_extras_metadata,
    verify_route_fragment_integrity,
)
from stage.routes.plan import RouteAssemblyPlan, RouteSpan

ROUTED_EXPERTS_FALLBACK_DTYPE = torch.int16  # output dtype whatever was staged
RouteResult = tuple[torch.Tensor | None, str | None]
DeviceSpec = str | torch.device | None


def execute_route_plan(
    plan: RouteAssemblyPlan,
    fragments: Mapping[str, RouteFragment],
    *,
    dims: tuple[int, int],
    canonical_len: int,
    device: DeviceSpec = "cpu",
    integrity: Callable[[RouteSpan, RouteFragment], bool] = verify_route_fragment_integrity,
) -> RouteResult:
    """Assemble ``[canonical_len, L, K]`` int16 routes (−1 where nothing contributed).

    ``integrity(span, fragment)`` is the receipt-bound check (a caller that already verified a
    fragment against that span's digest may answer from memory). Every row is written once:
    from a fragment (converted to int16 as it is copied) or with the sentinel."""
    if canonical_len != plan.expected_token_length:
        return None, ROUTE_FAILURE_CANONICAL_LENGTH
    layers, topk = dims
    target = resolve_device(device)
    out = torch.empty(
        (canonical_len, layers, topk), dtype=ROUTED_EXPERTS_FALLBACK_DTYPE, device=target
    )
    position = 0
    for span in plan.spans:
        contribution = span.carry_len + span.generation_len
        mode = classify_route_span(
            carry_len=span.carry_len,
            generation_len=span.generation_len,
            staged_route_len=span.staged_route_len,
        )
        if mode == ROUTE_SPAN_SENTINEL:
            out[position : position + contribution] = ROUTE_MISSING_SENTINEL
        else:
            fragment = fragments.get(span.staging_key)
            if fragment is None:
                return None, ROUTE_FAILURE_MISSING_FRAGMENT
            # Integrity before shape: an untrusted tensor's shape is not worth diagnosing.
            if not integrity(span, fragment):
                return None, ROUTE_FAILURE_INTEGRITY
            routes = fragment.routes
            if routes.dim() != 3:
                return None, ROUTE_FAILURE_RANK
            if routes.shape[0] != span.staged_route_len:
                return None, ROUTE_FAILURE_LENGTH
            if tuple(routes.shape[1:]) != (layers, topk):
                return None, ROUTE_FAILURE_MODEL_SHAPE
            boundary = fragment.boundary_routes
            # Integrity passed, so the metadata parses and any index in it is well formed.
            staged_index = metadata_boundary_index(
                parse_extras_metadata(fragment.extras_metadata_json)
            )
            if staged_index != span.boundary_token_index:
                return None, ROUTE_FAILURE_BOUNDARY
            if boundary is not None and tuple(boundary.shape) != (1, layers, topk):
                return None, ROUTE_FAILURE_BOUNDARY
            if position + contribution > canonical_len:
                # Only an unvalidated plan overruns the row. The span's own checks come first
                # (spec order); the overrun is what the final length check would report, said
                # here instead of a torch shape error on the write below.
                return None, ROUTE_FAILURE_ASSEMBLED_LENGTH

            if mode == ROUTE_SPAN_FULL:
                out[position : position + contribution].copy_(routes)
            else:  # tail: generated suffix only; carry positions stay sentinel
                gen = span.generation_len
                out[position : position + span.carry_len] = ROUTE_MISSING_SENTINEL
                out[position + span.carry_len : position + contribution].copy_(routes[-gen:])

            if span.repair_previous_token:
                if (
                    boundary is None
                    or position <= 0
                    or span.boundary_token_index != position - 1
                ):
                    return None, ROUTE_FAILURE_BOUNDARY
                # The parent's last sampled token was never routed by its own call;
                # the child's prefill routed it, so that route replaces the placeholder.
                out[position - 1].copy_(boundary[0])
        position += contribution
    if plan.spans and position != canonical_len:
        return None, ROUTE_FAILURE_ASSEMBLED_LENGTH
    out[position:] = ROUTE_MISSING_SENTINEL  # no spans at all: the whole row
    return out, None


def execute_direct_plan(
    plan: RouteAssemblyPlan,
    fetched_fragments: Mapping[str, RouteFragment | None],
    dims_cache: RouteDimsCache,
    *,
    device: DeviceSpec = "cpu",
) -> RouteResult:
    """Direct-mode pre-checks, then the shared executor (spec §3.7).

    ``fetched_fragments`` maps staging key -> fragment (None when the item staged none)
    in manifest order, off-chain calls included: the first fragment gives the rollout's dims,
    checked by ``dims_cache`` (configured dims, or the learned bound and the agreed dims:
    stage.routes.dims) before anything of that shape is allocated; the cache is not changed
    by one rollout's dims unless they are counted against agreed ones.
    Returns ``(None, None)`` for a valid rollout that staged no routes.
    """
    fragments = {k: f for k, f in fetched_fragments.items() if f is not None}
    if not any(span.staged_route_len > 0 for span in plan.spans):
        return None, None
    dims = dims_cache.dims
    if fragments:
        first = next(iter(fragments.values())).routes
        if first.dim() != 3:
            return None, ROUTE_FAILURE_RANK
        dims, failure = dims_cache.rollout_dims(first)
        if failure is not None:
            return None, failure
    if dims is None:
        return None, ROUTE_FAILURE_MISSING_FRAGMENT
    return execute_route_plan(
        plan,
        fragments,
        dims=dims,
        canonical_len=plan.expected_token_length,
        device=device,
    )


def build_group_route_tensor(
    rows_routes: Sequence[torch.Tensor | None],
    lengths: Sequence[int],
    dims_cache: RouteDimsCache,
    *,
    valid: Sequence[bool] | None = None,
    rollout_ids: Sequence[str] | None = None,
    max_len: int | None = None,
    device: DeviceSpec = "cpu",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group tensor ``[n, max_len, L, K]`` int16 for direct mode (spec §3.9).

    ``lengths[i]`` is row i's ``len(token_ids)`` (0 for placeholders); ``valid`` defaults to
    all rows valid; ``max_len`` defaults to ``max(max(1, length))`` as in finalize_group.
    The dims are the group's as ``dims_cache`` settles them from the valid rows' routes
    (stage.routes.dims). Raises RuntimeError when dims are unknown or a row's routes have the
    wrong shape.
    """
    valid_rows = [True] * len(rows_routes) if valid is None else list(valid)
    settled = dims_cache.settle([(int(r.shape[1]), int(r.shape[2])) for ok, r in zip(valid_rows, rows_routes)
                                 if ok and r is not None and r.dim() == 3])
    rows, metrics = group_route_rows(rows_routes, lengths, settled.dims, valid=valid,
                                     rollout_ids=rollout_ids, device=device)
    if max_len is None:
        max_len = max((max(1, length) for length in lengths), default=1)
    return pad_route_rows(rows, max_len, settled.dims, device=device), metrics


def group_route_rows(
    rows_routes: Sequence[torch.Tensor | None],
    lengths: Sequence[int],
    dims: tuple[int, int] | None,
    *,
    valid: Sequence[bool] | None = None,
    rollout_ids: Sequence[str] | None = None,
    device: DeviceSpec = "cpu",
) -> tuple[list[torch.Tensor | None], dict[str, float]]:
    """The group tensor's checks and metrics without building it: each valid row's routes as
    they are (``[length, L, K]``, all -1 for a valid row that staged none) and None for the
    placeholders, whose rows are all -1 (``pad_route_rows`` builds the tensor from these).
    ``dims``: the group's (L, K), settled before (stage.routes.dims); None: unknown."""
    n = len(rows_routes)
    if len(lengths) != n:
        raise ValueError(f"rows_routes and lengths must be parallel: {n} != {len(lengths)}")
    valid = [True] * n if valid is None else list(valid)
    ids = [str(i) for i in range(n)] if rollout_ids is None else list(rollout_ids)
    if len(valid) != n or len(ids) != n:
        raise ValueError("valid and rollout_ids must be parallel with rows_routes")

    if dims is None:
        raise RuntimeError(UNKNOWN_ROUTE_DIMS_MESSAGE)
    layers, topk = dims
    target = resolve_device(device)

    out: list[torch.Tensor | None] = []
    valid_rows = rows_with_routes = covered_tokens = sentinel_tokens = 0
    for i, (ok, routes, length) in enumerate(zip(valid, rows_routes, lengths)):
        if not ok:
            out.append(None)
            continue
        valid_rows += 1
        covered_tokens += length
        if routes is None:
            sentinel_tokens += length
            out.append(torch.full((length, layers, topk), ROUTE_MISSING_SENTINEL,
                                  dtype=ROUTED_EXPERTS_FALLBACK_DTYPE, device=target))
            continue
        expected = (length, layers, topk)
        if tuple(routes.shape) != expected:
            raise RuntimeError(
                f"rebuilt routed_experts shape {tuple(routes.shape)} does not match "
                f"{expected} for rollout {ids[i]}"
            )
        rows = routes.to(device=target, dtype=ROUTED_EXPERTS_FALLBACK_DTYPE)  # no copy if it is
        out.append(rows)
        rows_with_routes += 1
        sentinel_tokens += _unrouted_tokens(rows)

    metrics: dict[str, float] = {}
    if valid_rows:
        metrics[METRIC_ROUTED_EXPERTS_ROW_COVERAGE] = rows_with_routes / valid_rows
    if covered_tokens:
        metrics[METRIC_ROUTED_EXPERTS_SENTINEL_TOKEN_FRACTION] = sentinel_tokens / covered_tokens
    return out, metrics


def pad_route_rows(rows: Sequence[torch.Tensor | None], max_len: int, dims: tuple[int, int], *,
                   device: DeviceSpec = "cpu") -> torch.Tensor:
    """``[n, max_len, L, K]`` int16: each row's routes, -1 after them and for None rows."""
    layers, topk = dims
    target = resolve_device(device)
    # Written once per element: a row's routes, then the sentinel for the rest of its row.
    out = torch.empty((len(rows), max_len, layers, topk), dtype=ROUTED_EXPERTS_FALLBACK_DTYPE,
                      device=target)
    for i, routes in enumerate(rows):
        written = 0 if routes is None else int(routes.shape[0])
        if written:
            out[i, :written].copy_(routes)
        out[i, written:] = ROUTE_MISSING_SENTINEL
    return out


def _unrouted_tokens(rows: torch.Tensor) -> int:
    """Positions where every layer/top-k slot is the sentinel (the token got no route at all).

    A token's row can only be all sentinel if its first slot is: the full rows are compared for
    those candidates only (one slot per token read, not L*K)."""
    if rows.shape[0] == 0 or rows[0].numel() == 0:
        return 0
    flat = rows.reshape(rows.shape[0], -1)
    candidates = torch.nonzero(flat[:, 0] == ROUTE_MISSING_SENTINEL).flatten()
    if candidates.numel() == 0:
        return 0
    return int((flat[candidates] == ROUTE_MISSING_SENTINEL).all(dim=1).sum())
