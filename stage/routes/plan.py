"""Route assembly plan: model, validation, strict codec (spec §3.2, §3.4, §3.5).

A plan is the token-free recipe for rebuilding one canonical row's routed-expert tensor
from staged per-call fragments. Direct and deferred mode must produce byte-identical
encodings, so encoding is deterministic (fixed key order) and decoding accepts nothing
that the encoder would not have produced.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from stage.routes.constants import (
    LEGACY_ROUTE_PLAN_SCHEMA_VERSION,
    ROUTE_EXTRAS_DIGEST_VERSION,
    ROUTE_PLAN_FIELDS,
    ROUTE_PLAN_SCHEMA_VERSION,
    ROUTE_SPAN_FIELDS_V2,
    ROUTE_SPAN_FIELDS_V3,
    SUPPORTED_ROUTE_PLAN_SCHEMA_VERSIONS,
)

_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class RouteSpan:
    """One terminal-chain call's contribution to the canonical row (root first)."""

    staging_key: str
    carry_len: int
    generation_len: int
    staged_route_len: int
    extras_digest_version: int
    extras_digest: str
    # v3: canonical index of the parent's last token (position - 1), staged by the child.
    boundary_token_index: int | None = None
    # v3: overwrite that row with the child's prefill route (vLLM never routes a last sampled token).
    repair_previous_token: bool = False


@dataclass(frozen=True)
class RouteAssemblyPlan:
    schema_version: int
    staging_partition: str
    spans: tuple[RouteSpan, ...]
    # The whole manifest (off-chain keys too): this is staging ownership, not just what is read.
    cleanup_staging_keys: tuple[str, ...]
    expected_token_length: int

    def __post_init__(self) -> None:
        # Lists are accepted for convenience but stored as tuples so the plan stays hashable.
        for name in ("spans", "cleanup_staging_keys"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))


def _require_int(value: Any, name: str) -> None:
    # Exact type check: bool is an int subclass and must not pass as a length.
    if type(value) is not int:
        raise TypeError(f"{name} must be int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")


def _require_str(value: Any, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty string")


def validate_route_plan(plan: RouteAssemblyPlan) -> None:
    """Raise TypeError/ValueError unless ``plan`` is well formed (spec §3.4, in that order)."""
    version = plan.schema_version
    if type(version) is not int or version not in SUPPORTED_ROUTE_PLAN_SCHEMA_VERSIONS:
        raise ValueError(
            f"unsupported route plan schema version {version}; expected 2 (legacy) or 3"
        )
    _require_str(plan.staging_partition, "route_plan.staging_partition")
    _require_int(plan.expected_token_length, "route_plan.expected_token_length")

    keys = plan.cleanup_staging_keys
    if not isinstance(keys, tuple):
        raise TypeError("route_plan.cleanup_staging_keys must be a tuple")
    try:
        duplicated = len(set(keys)) != len(keys)
    except TypeError:  # unhashable entry: reported by the per-key check below
        duplicated = False
    if duplicated:
        raise ValueError("route_plan.cleanup_staging_keys contains duplicates")
    for j, key in enumerate(keys):
        _require_str(key, f"route_plan.cleanup_staging_keys[{j}]")
    owned = frozenset(keys)

    if not isinstance(plan.spans, tuple):
        raise TypeError("route_plan.spans must be a tuple")
    position = 0
    previous: RouteSpan | None = None
    for i, span in enumerate(plan.spans):
        where = f"route_plan.spans[{i}]"
        if not isinstance(span, RouteSpan):
            raise TypeError(f"{where} must be a RouteSpan")
        _require_str(span.staging_key, f"{where}.staging_key")
        for name in ("carry_len", "generation_len", "staged_route_len"):
            _require_int(getattr(span, name), f"{where}.{name}")
        if (
            type(span.extras_digest_version) is not int
            or span.extras_digest_version != ROUTE_EXTRAS_DIGEST_VERSION
        ):
            raise ValueError(f"{where}.extras_digest_version must be 1")
        if not isinstance(span.extras_digest, str) or not _HEX_DIGEST.fullmatch(span.extras_digest):
            raise ValueError(f"{where}.extras_digest must be a lowercase SHA-256 hex digest")
        if span.staging_key not in owned:
            raise ValueError(f"{where} key {span.staging_key!r} is outside cleanup_staging_keys")
        _validate_boundary(span, i, where, version, position, previous)
        position += span.carry_len + span.generation_len
        previous = span

    # A span-less (placeholder) plan may carry any length.
    if plan.spans and position != plan.expected_token_length:
        raise ValueError(
            f"route plan spans contribute {position} tokens, expected {plan.expected_token_length}"
        )


def _validate_boundary(
    span: RouteSpan, i: int, where: str, version: int, position: int, previous: RouteSpan | None
) -> None:
    if type(span.repair_previous_token) is not bool:
        raise TypeError(f"{where}.repair_previous_token must be bool")
    index = span.boundary_token_index
    if index is not None:
        _require_int(index, f"{where}.boundary_token_index")
        if (
            version == LEGACY_ROUTE_PLAN_SCHEMA_VERSION
            or position == 0
            or index != position - 1
            or span.staged_route_len == 0
        ):
            raise ValueError(f"{where} has an invalid boundary token index")
    if span.repair_previous_token and (
        index is None
        or i == 0
        or previous is None
        or previous.generation_len <= 0
        or span.generation_len <= 0
    ):
        raise ValueError(f"{where} boundary repair requires adjacent generated spans")


# --- encode / decode ----------------------------------------------------------------------


def encode_route_plan(plan: RouteAssemblyPlan) -> dict[str, Any]:
    """Validate, then return the JSON-able tag dict (key order fixed by the spec)."""
    validate_route_plan(plan)
    return _plan_dict(plan)


def _plan_dict(plan: RouteAssemblyPlan) -> dict[str, Any]:
    span_fields = (
        ROUTE_SPAN_FIELDS_V2
        if plan.schema_version == LEGACY_ROUTE_PLAN_SCHEMA_VERSION
        else ROUTE_SPAN_FIELDS_V3
    )
    return {
        "schema_version": plan.schema_version,
        "staging_partition": plan.staging_partition,
        "spans": [{name: getattr(span, name) for name in span_fields} for span in plan.spans],
        "cleanup_staging_keys": list(plan.cleanup_staging_keys),
        "expected_token_length": plan.expected_token_length,
    }


def _exact_fields(obj: dict, expected: tuple[str, ...], where: str) -> None:
    if set(obj) != set(expected):
        got = sorted(obj, key=repr)
        raise ValueError(f"{where} fields must be exactly {sorted(expected)}, got {got}")


def decode_route_plan(obj: Any) -> RouteAssemblyPlan:
    """Strictly rebuild a plan from its encoded dict: no defaults, no coercion, re-validated."""
    if not isinstance(obj, dict):
        raise TypeError(f"route plan must be a dict, got {type(obj).__name__}")
    _exact_fields(obj, ROUTE_PLAN_FIELDS, "route_plan")
    version = obj["schema_version"]
    if type(version) is not int or version not in SUPPORTED_ROUTE_PLAN_SCHEMA_VERSIONS:
        raise ValueError(
            f"unsupported route plan schema version {version}; expected 2 (legacy) or 3"
        )
    raw_spans, raw_keys = obj["spans"], obj["cleanup_staging_keys"]
    if not isinstance(raw_spans, list):
        raise TypeError(f"route_plan.spans must be a list, got {type(raw_spans).__name__}")
    if not isinstance(raw_keys, list):
        raise TypeError(
            f"route_plan.cleanup_staging_keys must be a list, got {type(raw_keys).__name__}"
        )
    legacy = version == LEGACY_ROUTE_PLAN_SCHEMA_VERSION
    span_fields = ROUTE_SPAN_FIELDS_V2 if legacy else ROUTE_SPAN_FIELDS_V3
    spans = []
    for i, raw in enumerate(raw_spans):
        if not isinstance(raw, dict):
            raise TypeError(f"route_plan.spans[{i}] must be a dict, got {type(raw).__name__}")
        _exact_fields(raw, span_fields, f"route_plan.spans[{i}]")
        # v2 spans take the dataclass defaults (no index, no repair). Field types (exact
        # ints, bool flag, non-empty strings) are enforced by the validation below.
        spans.append(RouteSpan(**raw))
    plan = RouteAssemblyPlan(
        schema_version=version,
        staging_partition=obj["staging_partition"],
        spans=tuple(spans),
        cleanup_staging_keys=tuple(raw_keys),
        expected_token_length=obj["expected_token_length"],
    )
    validate_route_plan(plan)
    return plan


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads silently keeps the last duplicate; a strict wire format must not.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"route plan JSON repeats key {key!r}")
        result[key] = value
    return result


def dumps_route_plan(plan: RouteAssemblyPlan) -> bytes:
    """Compact UTF-8 JSON of the encoded plan (the form whose size is reported)."""
    return json.dumps(encode_route_plan(plan), separators=(",", ":")).encode("utf-8")


def loads_route_plan(data: bytes | str) -> RouteAssemblyPlan:
    """Inverse of :func:`dumps_route_plan`; strict (duplicate JSON keys rejected)."""
    return decode_route_plan(json.loads(data, object_pairs_hook=_reject_duplicate_keys))


def encoded_route_plan_size_bytes(plan: RouteAssemblyPlan) -> int:
    return len(dumps_route_plan(plan))


def validated_route_plan_size_bytes(plan: RouteAssemblyPlan) -> int:
    """``encoded_route_plan_size_bytes`` of a plan already validated (one from
    ``build_route_plan`` or ``placeholder_route_plan``): the same size, without validating its
    every span again (a row's plan is ~60 spans at agentic sizes; the finalizer sums the sizes
    of every row's plan into a metric)."""
    return len(json.dumps(_plan_dict(plan), separators=(",", ":")).encode("utf-8"))


def placeholder_route_plan(
    *,
    staging_partition: str,
    cleanup_staging_keys: tuple[str, ...] | list[str] = (),
    expected_token_length: int = 1,
    schema_version: int = ROUTE_PLAN_SCHEMA_VERSION,
) -> RouteAssemblyPlan:
    """Empty-span plan tagged on rejected rows in deferred mode (spec §3.10).

    It assembles to an all-sentinel row and still hands the row's staged keys to cleanup.
    Keys are de-duplicated (first occurrence kept) because a rejected row may have been
    rejected precisely for a duplicated manifest key.
    """
    plan = RouteAssemblyPlan(
        schema_version=schema_version,
        staging_partition=staging_partition,
        spans=(),
        cleanup_staging_keys=tuple(dict.fromkeys(cleanup_staging_keys)),
        expected_token_length=expected_token_length,
    )
    validate_route_plan(plan)
    return plan
