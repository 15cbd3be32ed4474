"""Wire records of the staging contract with Gym's field names, JSON form and model rules.

Gym uses pydantic; this is a dependency-free equivalent: ``Record(**fields)`` validates (field
rules first, then the model rules in Gym's order, first failure wins), ``Record.construct``
skips validation (pydantic's ``model_construct``, for tests and trusted internal paths),
``from_json`` accepts a dict, str or bytes, ``to_json`` returns the dict Gym would dump.
Token columns are held as numpy arrays (uint64 ids, float64 masks and log-probs).
"""

from __future__ import annotations

import json
import re
from operator import itemgetter
from typing import Any, Callable, ClassVar

import numpy as np

from . import fields as F
from .constants import (
    CAPTURE_DISPOSITIONS,
    CAPTURE_MODES,
    EMPTY_EXTRAS_DIGEST,
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    TERMINAL_SELECTIONS,
)
from .digests import compute_extras_digest, compute_staging_digest
from .fields import FieldError, WireValidationError

_REQUIRED = object()
# JSON text larger than this is refused before parsing (a staged call of 1M tokens is ~20 MB).
MAX_JSON_BYTES = 256 << 20


def _reject_constant(name: str):
    raise ValueError(f"non-finite JSON number {name} is not allowed")


def parse_json_text(obj, model: str):
    if isinstance(obj, (bytes, bytearray, memoryview)):
        if len(obj) > MAX_JSON_BYTES:
            raise WireValidationError(model, None, f"JSON text exceeds {MAX_JSON_BYTES} bytes")
        try:
            obj = bytes(obj).decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireValidationError(model, None, f"JSON text is not UTF-8: {e}") from None
    if isinstance(obj, str):
        if len(obj) > MAX_JSON_BYTES:
            raise WireValidationError(model, None, f"JSON text exceeds {MAX_JSON_BYTES} bytes")
        try:
            return json.loads(obj, parse_constant=_reject_constant)
        except RecursionError:
            raise WireValidationError(model, None, "JSON nesting is too deep") from None
        except ValueError as e:
            raise WireValidationError(model, None, f"invalid JSON: {e}") from None
    return obj


class WireRecord:
    """Base of every wire record: declarative fields + ordered model rules."""

    FIELDS: ClassVar[tuple[tuple[str, Callable[[Any], Any], Any], ...]] = ()
    __slots__ = ()

    def __init__(self, **values: Any) -> None:
        name = type(self).__name__
        known = {f[0] for f in self.FIELDS}
        for key in values:
            if key not in known:
                raise WireValidationError(name, str(key)[:80], "extra fields are not permitted")
        for field, parse, default in self.FIELDS:
            if field in values:
                try:
                    value = parse(values[field])
                except FieldError as e:
                    raise WireValidationError(name, field, str(e)) from None
                except WireValidationError as e:  # nested record
                    raise WireValidationError(name, f"{field}{_suffix(e)}", e.reason) from None
            elif default is _REQUIRED:
                raise WireValidationError(name, field, "field required")
            else:
                value = default() if callable(default) else default
            object.__setattr__(self, field, value)
        try:
            self._check()
        except WireValidationError:
            raise
        except (ValueError, TypeError, OverflowError) as e:
            raise WireValidationError(name, None, str(e)) from None

    def _check(self) -> None:
        """Model-level rules; raise ValueError with Gym's exact text."""

    @classmethod
    def construct(cls, **values: Any):
        """Build without validation (pydantic's model_construct)."""
        self = cls.__new__(cls)
        for field, _parse, default in cls.FIELDS:
            if field in values:
                value = values[field]
            elif default is _REQUIRED:
                value = None
            else:
                value = default() if callable(default) else default
            object.__setattr__(self, field, value)
        return self

    @classmethod
    def from_json(cls, obj):
        """Load Gym's JSON wire form (a dict, or JSON text as str/bytes)."""
        obj = parse_json_text(obj, cls.__name__)
        if type(obj) is not dict:
            raise WireValidationError(cls.__name__, None,
                                      f"expected a JSON object, got {type(obj).__name__}")
        if not all(type(k) is str for k in obj):
            raise WireValidationError(cls.__name__, None, "object keys must be strings")
        return cls(**obj)

    def to_json(self) -> dict:
        """Gym's ``model_dump(mode="json")``: declaration order, optionals as null."""
        return {field: _dump(getattr(self, field)) for field, _p, _d in self.FIELDS}

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), ensure_ascii=False, separators=(",", ":"))

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        shown = ", ".join(f"{f}={_short(getattr(self, f))}" for f, _p, _d in self.FIELDS)
        return f"{type(self).__name__}({shown})"


def _suffix(e: WireValidationError) -> str:
    return f".{e.field}" if e.field else ""


def _dump(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, WireRecord):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    return value


def _short(value) -> str:
    if isinstance(value, np.ndarray):
        return f"array(len={value.size}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _schema() -> tuple:
    return ("schema_version", F.literal(STAGING_SCHEMA_VERSION), STAGING_SCHEMA_VERSION)


def _digest_versions() -> tuple:
    return (
        _schema(),
        ("digest_version", F.literal(STAGING_DIGEST_VERSION), STAGING_DIGEST_VERSION),
        ("extras_digest_version", F.literal(EXTRAS_DIGEST_VERSION), EXTRAS_DIGEST_VERSION),
    )


_MODE = F.literal(*CAPTURE_MODES)


def _record_list(record_cls):
    def parse(v):
        if type(v) is not list:
            raise FieldError(f"expected a list, got {type(v).__name__}")
        if record_cls is CallRecord:
            plain = _plain_call_records(v)
            if plain is not None:
                return plain
        out = []
        for i, item in enumerate(v):
            if isinstance(item, record_cls):
                out.append(item)
                continue
            if type(item) is not dict or not all(type(k) is str for k in item):
                raise FieldError(f"item {i}: expected an object")
            try:
                out.append(record_cls(**item))
            except WireValidationError as e:
                raise WireValidationError(record_cls.__name__, f"[{i}]{_suffix(e)}", e.reason) from None
        return out
    return parse


# --------------------------------------------------------------------------------------------

class CaptureAdmission(WireRecord):
    FIELDS = (
        _schema(),
        ("rollout_id", F.identifier, _REQUIRED),
        ("model_call_id", F.identifier, _REQUIRED),
        ("parent_call_id", F.opt_identifier, None),
        ("prev_len", F.nonneg_int, 0),
        ("mode", _MODE, _REQUIRED),
        ("required_prefix_token_ids", F.int_list, list),
        ("staging_chain", F.str_list, list),
        ("parent_chain_hash", F.opt_digest_hex, None),
    )
    __slots__ = tuple(f[0] for f in FIELDS)

    def _check(self) -> None:
        if any(t < 0 for t in self.required_prefix_token_ids):
            raise ValueError("required_prefix_token_ids must be non-negative")
        if self.mode == "token_in":
            if self.parent_call_id is None or self.prev_len == 0:
                raise ValueError("token_in admission requires a parent_call_id and prev_len > 0")
            if self.parent_chain_hash is None:
                raise ValueError("token_in admission requires the parent's chain hash")
            if not self.staging_chain and len(self.required_prefix_token_ids) != self.prev_len:
                raise ValueError("required_prefix_token_ids length must equal prev_len")
        elif (self.parent_call_id is not None or self.prev_len != 0
              or self.required_prefix_token_ids or self.staging_chain
              or self.parent_chain_hash is not None):
            raise ValueError("text admission must be a parentless root with no required prefix")


class StagedCallBaseSnapshot(WireRecord):
    """One staged call's token delta plus metadata, without extras (Gym section 2.2)."""

    FIELDS = (
        *_digest_versions(),
        ("rollout_id", F.identifier, _REQUIRED),
        ("model_call_id", F.identifier, _REQUIRED),
        ("parent_call_id", F.opt_identifier, None),
        ("mode", _MODE, _REQUIRED),
        ("prev_len", F.nonneg_int, _REQUIRED),
        ("delta_len", F.nonneg_int, _REQUIRED),
        ("cum_len", F.nonneg_int, _REQUIRED),
        ("weight_version", F.nonneg_int, _REQUIRED),
        ("digest", F.digest_hex, _REQUIRED),
        ("token_ids_delta", F.token_column, _REQUIRED),
        ("token_mask_delta", F.float_column, _REQUIRED),
        ("generation_log_probs_delta", F.float_column, _REQUIRED),
        ("extras_digest", F.digest_hex, EMPTY_EXTRAS_DIGEST),
        ("chain_hash", F.digest_hex, _REQUIRED),
        ("cumulative_hash", F.digest_hex, _REQUIRED),
    )
    __slots__ = tuple(f[0] for f in FIELDS)

    @property
    def staging_key(self) -> str:
        return f"{self.rollout_id}/{self.model_call_id}"

    def digest_fields(self) -> dict:
        """The keyword arguments of compute_staging_digest, taken from this record."""
        return {name: getattr(self, name) for name in _DIGEST_ARGS}

    def _check(self) -> None:
        parent = self.parent_call_id
        if parent is None and self.prev_len != 0:
            raise ValueError("a parentless staged call must have prev_len == 0")
        if parent is not None and self.prev_len == 0:
            raise ValueError("a child staged call must have prev_len > 0")
        if parent is None and self.mode != "text":
            raise ValueError("a parentless staged call must use text mode")
        if parent is not None and self.mode != "token_in":
            raise ValueError("a child staged call must use token_in mode")
        if self.delta_len == 0:
            raise ValueError("a staged call delta must contain at least one token")
        ids = self.token_ids_delta
        if not isinstance(ids, np.ndarray) and any(t < 0 for t in ids):
            raise ValueError("token_ids_delta must be non-negative")
        mask, lps = self.token_mask_delta, self.generation_log_probs_delta
        if not ((mask == 0.0) | (mask == 1.0)).all():
            raise ValueError("token_mask_delta must contain only 0.0 or 1.0")
        n = min(len(mask), len(lps))
        if ((mask[:n] == 0.0) & (lps[:n] != 0.0)).any():
            raise ValueError("prompt-carry log probabilities must be 0.0")
        if compute_staging_digest(**self.digest_fields()) != self.digest:
            raise ValueError("digest does not match staged call contents")


_DIGEST_ARGS = tuple(f[0] for f in StagedCallBaseSnapshot.FIELDS if f[0] != "digest")


class StagedCallRecord(StagedCallBaseSnapshot):
    """A staged call with the extras its extras_digest commits to (Gym section 2.3)."""

    FIELDS = (*StagedCallBaseSnapshot.FIELDS, ("extras", F.extras_dict, None))
    __slots__ = ("extras",)

    def _check(self) -> None:
        super()._check()
        if compute_extras_digest(self.extras) != self.extras_digest:
            raise ValueError("extras_digest does not match extras")

    def base_snapshot(self) -> StagedCallBaseSnapshot:
        values = {f[0]: getattr(self, f[0]) for f in StagedCallBaseSnapshot.FIELDS}
        return StagedCallBaseSnapshot.construct(**values)


class StagedCallSnapshot(StagedCallRecord):
    """The exact staged record returned by a framework-owned source."""

    __slots__ = ()


class StageResult(WireRecord):
    FIELDS = (
        _schema(),
        ("ok", F.lax_bool, _REQUIRED),
        ("staging_key", F.opt_identifier, None),
        ("error", F.opt_plain_str, None),
    )
    __slots__ = tuple(f[0] for f in FIELDS)

    def _check(self) -> None:
        if self.ok and self.staging_key is None:
            raise ValueError("a successful stage result requires staging_key")
        if not self.ok and not self.error:
            raise ValueError("a failed stage result requires an error")


_STAGED_PAYLOAD = ("digest", "extras_digest", "staging_key", "chain_hash", "cumulative_hash")


class CommitCoords(WireRecord):
    FIELDS = (
        *_digest_versions(),
        ("rollout_id", F.identifier, _REQUIRED),
        ("model_call_id", F.identifier, _REQUIRED),
        ("parent_call_id", F.opt_identifier, None),
        ("prev_len", F.nonneg_int, _REQUIRED),
        ("delta_len", F.nonneg_int, _REQUIRED),
        ("cum_len", F.nonneg_int, _REQUIRED),
        ("weight_version", F.nonneg_int, _REQUIRED),
        ("disposition", F.literal(*CAPTURE_DISPOSITIONS), "staged"),
        ("digest", F.opt_digest_hex, None),
        ("extras_digest", F.opt_digest_hex, None),
        ("staging_key", F.opt_identifier, None),
        ("chain_hash", F.opt_digest_hex, None),
        ("cumulative_hash", F.opt_digest_hex, None),
    )
    __slots__ = tuple(f[0] for f in FIELDS)

    def _check(self) -> None:
        if self.parent_call_id is None and self.prev_len != 0:
            raise ValueError("parentless coordinates must have prev_len == 0")
        if self.parent_call_id is not None and self.prev_len == 0:
            raise ValueError("child coordinates must have prev_len > 0")
        if self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("cum_len must equal prev_len + delta_len")
        payload = [getattr(self, name) for name in _STAGED_PAYLOAD]
        if self.disposition == "staged":
            if any(v is None for v in payload):
                raise ValueError("staged coordinates require digest, extras_digest, staging_key, "
                                 "chain_hash, and cumulative_hash")
            if self.delta_len == 0:
                raise ValueError("staged coordinates require a non-empty delta")
        else:
            if any(v is not None for v in payload):
                raise ValueError("capture_failed coordinates cannot carry staged payload metadata")
            if self.delta_len != 0:
                raise ValueError("capture_failed coordinates cannot carry token deltas")


class CallRecord(WireRecord):
    """One token-free manifest row (Gym section 2.6). It has no rollout_id: the receipt's."""

    FIELDS = (
        *_digest_versions(),
        ("model_call_id", F.identifier, _REQUIRED),
        ("parent_call_id", F.opt_identifier, None),
        ("prev_len", F.nonneg_int, _REQUIRED),
        ("delta_len", F.nonneg_int, _REQUIRED),
        ("cum_len", F.nonneg_int, _REQUIRED),
        ("weight_version", F.nonneg_int, _REQUIRED),
        ("digest", F.digest_hex, _REQUIRED),
        ("extras_digest", F.digest_hex, _REQUIRED),
        ("staging_key", F.identifier, _REQUIRED),
        ("mode", _MODE, "token_in"),
        ("chain_hash", F.digest_hex, _REQUIRED),
        ("cumulative_hash", F.digest_hex, _REQUIRED),
        ("response_id", F.identifier, _REQUIRED),
        ("admitted_at", F.opt_strict_float, None),
        ("output_fingerprint", F.opt_digest_hex, None),
        ("continuation_fingerprint", F.opt_digest_hex, None),
        ("fingerprint_version", F.nonneg_int, 0),
    )
    __slots__ = tuple(f[0] for f in FIELDS)

    def _check(self) -> None:
        if self.delta_len == 0 or self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("manifest lengths must describe a non-empty contiguous delta")
        if self.parent_call_id is None and self.prev_len != 0:
            raise ValueError("a parentless manifest row must have prev_len == 0")
        if self.parent_call_id is not None and self.prev_len == 0:
            raise ValueError("a child manifest row must have prev_len > 0")
        if self.parent_call_id is None and self.mode != "text":
            raise ValueError("a parentless manifest row must use text mode")
        if self.parent_call_id is not None and self.mode != "token_in":
            raise ValueError("a child manifest row must use token_in mode")


_CALL_NAMES = tuple(f[0] for f in CallRecord.FIELDS)
_CALL_KEYS = frozenset(_CALL_NAMES)
_call_values = itemgetter(*_CALL_NAMES)
_HEX_RUN = re.compile(r"[0-9a-f]*")


def _plain_call_records(items: list) -> list | None:
    """The manifest rows of ``items`` without a parser call per field (issue 31: ~12 us a row
    that way; a 64-call receipt cost half as much as verifying its rollout), when every item
    is a dict with every CallRecord field, each value one its parser returns unchanged, and the
    model rules hold; else None, and each item is parsed as before (the first error, in order,
    with its text). The digests are checked together: one regex over their concatenation."""
    out, digests = [], []
    new, values_of, put = CallRecord.__new__, _call_values, object.__setattr__
    for item in items:
        if type(item) is not dict or item.keys() != _CALL_KEYS:
            return None
        values = values_of(item)
        (schema, digest_v, extras_v, call_id, parent, prev, delta, cum, weight, digest, extras,
         key, mode, chain, cumulative, response, admitted, out_fp, cont_fp, fp_v) = values
        if not (type(schema) is int and schema == 2 and type(digest_v) is int and digest_v == 2
                and type(extras_v) is int and extras_v == 1
                and type(call_id) is str and call_id and type(key) is str and key
                and type(response) is str and response
                and type(prev) is int and type(delta) is int and type(cum) is int
                and type(weight) is int and type(fp_v) is int
                and prev >= 0 and delta > 0 and weight >= 0 and fp_v >= 0 and cum == prev + delta
                and (prev == 0 and mode == "text" if parent is None else
                     type(parent) is str and parent and prev != 0 and mode == "token_in")
                and type(mode) is str
                and (admitted is None or (type(admitted) is float and admitted - admitted == 0.0))):
            return None
        for text in (digest, extras, chain, cumulative):
            if type(text) is not str or len(text) != 64:
                return None
        digests += (digest, extras, chain, cumulative)
        for text in (out_fp, cont_fp):   # optional: None stays None
            if text is not None:
                if type(text) is not str or len(text) != 64:
                    return None
                digests.append(text)
        record = new(CallRecord)
        for name, value in zip(_CALL_NAMES, values):
            put(record, name, value)
        out.append(record)
    if digests and _HEX_RUN.fullmatch("".join(digests)) is None:
        return None
    return out


class ManifestFailure(WireRecord):
    FIELDS = (
        _schema(),
        ("model_call_id", F.identifier, _REQUIRED),
        ("reason", F.identifier, _REQUIRED),
    )
    __slots__ = tuple(f[0] for f in FIELDS)


class RolloutManifest(WireRecord):
    FIELDS = (
        _schema(),
        ("rollout_id", F.identifier, _REQUIRED),
        ("records", _record_list(CallRecord), list),
        ("failures", _record_list(ManifestFailure), list),
    )
    __slots__ = tuple(f[0] for f in FIELDS)


class RolloutReceipt(WireRecord):
    """Framework-assembled, token-free receipt of one rollout (Gym section 2.9)."""

    FIELDS = (
        *_digest_versions(),
        ("rollout_id", F.identifier, _REQUIRED),
        ("reward", F.opt_lax_float, None),
        ("terminal_model_call_id", F.opt_identifier, None),
        ("manifest", _record_list(CallRecord), list),
        ("capture_poisoned", F.lax_bool, False),
        ("failure_reason", F.opt_plain_str, None),
        ("terminal_selection", F.opt_literal(*TERMINAL_SELECTIONS), None),
        ("terminal_attribution_reason", F.opt_plain_str, None),
    )
    __slots__ = tuple(f[0] for f in FIELDS)

    def _check(self) -> None:
        ids = [r.model_call_id for r in self.manifest]
        if len(set(ids)) != len(ids):
            raise ValueError("receipt manifest contains duplicate model_call_id values")
        terminal = self.terminal_model_call_id
        if terminal is not None and terminal not in ids:
            raise ValueError("terminal_model_call_id is absent from the receipt manifest")
        if not self.capture_poisoned:
            if self.failure_reason is not None:
                raise ValueError("an unpoisoned receipt cannot carry a failure_reason")
            if terminal is None or self.terminal_selection is None:
                raise ValueError(
                    "an unpoisoned receipt must name terminal_model_call_id and terminal_selection")
        if self.terminal_selection is None:
            if terminal is not None:
                raise ValueError("terminal_model_call_id requires a terminal_selection method")
            if self.failure_reason is None:
                raise ValueError(
                    "a receipt with no attribution stage must be poisoned with a failure_reason")


def default_staging_key(rollout_id: str, model_call_id: str) -> str:
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    return f"{rollout_id}/{model_call_id}"
