"""Build a route plan from a verified rollout (spec §2 guards 15-21, §3.2).

Direct and deferred mode both call this with the same inputs, which is what makes their
published plans byte-identical. Any rollout-level problem raises
:class:`RoutePlanBuildError` whose ``reason`` is the finalizer's exact rejection string.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from stage.routes.constants import (
    LEGACY_BOUNDARY_WARNING,
    LEGACY_ROUTE_PLAN_SCHEMA_VERSION,
    REJECT_DUPLICATE_ROUTE_SPAN,
    REJECT_INVALID_ROUTE_PLAN,
    REJECT_ROUTE_BOUNDARY_INDEX_MISMATCH,
    REJECT_ROUTE_CARRY_SPAN_MISMATCH,
    REJECT_ROUTE_GENERATION_SPAN_MISMATCH,
    REJECT_ROUTE_SPAN_IDENTITY,
    REJECT_ROUTE_SPAN_LENGTH_MISMATCH,
    REJECT_ROUTED_LEN_MISMATCH,
    ROUTE_PLAN_SCHEMA_VERSION,
)
from stage.routes.plan import RouteAssemblyPlan, RouteSpan, validate_route_plan

logger = logging.getLogger(__name__)


class RoutePlanBuildError(ValueError):
    """A rollout cannot get a route plan; ``reason`` is the rejection string to publish."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _as_int(value: Any) -> int | None:
    # Staged columns may hand back numpy integers; accept any true integral, never bool.
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def build_route_plan(
    *,
    staging_partition: str,
    link_spans: Sequence[tuple[str, int, int]],
    records_by_call: Mapping[str, Any],
    routed_len_by_call: Mapping[str, Any],
    extras_commitments: Sequence[Any],
    cleanup_staging_keys: Sequence[str],
    expected_token_length: int,
    boundary_index_by_call: Mapping[str, Any] | None = None,
    schema_version: int = ROUTE_PLAN_SCHEMA_VERSION,
) -> RouteAssemblyPlan:
    """Join Gym link spans with manifest records, fetched items and extras commitments.

    * ``link_spans``: ``(model_call_id, carry_len, generation_len)`` root first (Gym).
    * ``records_by_call``: manifest ``CallRecord``-likes (``staging_key``, ``delta_len``,
      ``prev_len``, ``mode``) by call id.
    * ``routed_len_by_call``: fetched items' ``routed_len`` by call id (absent = not fetched).
    * ``extras_commitments``: Gym ``ExtrasCommitment``-likes (``model_call_id``,
      ``extras_digest_version``, ``extras_digest``).
    * ``boundary_index_by_call``: staged ``routed_experts_boundary_index`` (v3 only).
    * ``cleanup_staging_keys``: every manifest key, off-chain included.
    """
    commitments = {c.model_call_id: c for c in extras_commitments}
    boundary = boundary_index_by_call or {}
    legacy = schema_version == LEGACY_ROUTE_PLAN_SCHEMA_VERSION
    spans: list[RouteSpan] = []
    seen: set[str] = set()
    position = 0
    for call_id, carry_len, generation_len in link_spans:
        if call_id in seen:
            raise RoutePlanBuildError(f"{REJECT_DUPLICATE_ROUTE_SPAN}:{call_id}")
        seen.add(call_id)
        record = records_by_call.get(call_id)
        commitment = commitments.get(call_id)
        if record is None or call_id not in routed_len_by_call or commitment is None:
            raise RoutePlanBuildError(f"{REJECT_ROUTE_SPAN_IDENTITY}:{call_id}")
        routed_len = _as_int(routed_len_by_call[call_id])
        if routed_len is None or routed_len not in (0, record.delta_len):
            raise RoutePlanBuildError(f"{REJECT_ROUTED_LEN_MISMATCH}:{call_id}")
        if generation_len < 0 or generation_len > record.delta_len:
            raise RoutePlanBuildError(f"{REJECT_ROUTE_GENERATION_SPAN_MISMATCH}:{call_id}")
        if carry_len < 0:
            raise RoutePlanBuildError(f"{REJECT_ROUTE_CARRY_SPAN_MISMATCH}:{call_id}")

        index = None if legacy else boundary.get(call_id)
        if index is not None:
            index = _as_int(index)
            if (
                index is None
                or record.mode != "token_in"
                or position == 0
                or record.prev_len != position
                or index != position - 1
                or routed_len == 0
            ):
                raise RoutePlanBuildError(f"{REJECT_ROUTE_BOUNDARY_INDEX_MISMATCH}:{call_id}")

        adjacent_generation = bool(spans) and spans[-1].generation_len > 0 and generation_len > 0
        repair = adjacent_generation and index is not None
        if not legacy and adjacent_generation and routed_len > 0 and index is None:
            # Old captures cannot repair the parent's unrouted last token; train on, but say so.
            logger.warning(LEGACY_BOUNDARY_WARNING, call_id)

        spans.append(
            RouteSpan(
                staging_key=record.staging_key,
                carry_len=carry_len,
                generation_len=generation_len,
                staged_route_len=routed_len,
                extras_digest_version=commitment.extras_digest_version,
                extras_digest=commitment.extras_digest,
                boundary_token_index=index,
                repair_previous_token=repair,
            )
        )
        position += carry_len + generation_len

    if position != expected_token_length:
        raise RoutePlanBuildError(REJECT_ROUTE_SPAN_LENGTH_MISMATCH)
    plan = RouteAssemblyPlan(
        schema_version=schema_version,
        staging_partition=staging_partition,
        spans=tuple(spans),
        cleanup_staging_keys=tuple(cleanup_staging_keys),
        expected_token_length=expected_token_length,
    )
    try:
        validate_route_plan(plan)
    except (TypeError, ValueError) as error:
        raise RoutePlanBuildError(f"{REJECT_INVALID_ROUTE_PLAN}:{error}") from error
    return plan
