"""Field-level parsers for the wire records (Gym's pydantic field rules, without pydantic).

Each parser takes an untrusted value and returns the normalized one or raises
``FieldError``; the record layer adds the model and field name.
"""

from __future__ import annotations

import math

import numpy as np

from .encoding import is_digest_hex


class FieldError(ValueError):
    pass


class WireValidationError(ValueError):
    """A wire record failed validation. ``model`` and ``field`` say where (field is None for
    a model-level rule, whose text is then exactly Gym's)."""

    def __init__(self, model: str, field: str | None, message: str) -> None:
        where = f"{model}.{field}" if field else model
        super().__init__(f"{where}: {message}")
        self.model = model
        self.field = field
        self.reason = message


def identifier(v):
    if type(v) is not str:
        raise FieldError(f"expected a string, got {type(v).__name__}")
    if not v:
        raise FieldError("must be a non-empty string")
    return v


def opt_identifier(v):
    return None if v is None else identifier(v)


def plain_str(v):
    if type(v) is not str:
        raise FieldError(f"expected a string, got {type(v).__name__}")
    return v


def opt_plain_str(v):
    return None if v is None else plain_str(v)


def nonneg_int(v):
    if type(v) is not int:
        raise FieldError(f"expected an integer, got {type(v).__name__}")
    if v < 0:
        raise FieldError(f"must be >= 0, got {v}")
    return v


def digest_hex(v):
    if not is_digest_hex(v):
        raise FieldError("must be a 64-character lowercase hex SHA-256 digest")
    return v


def opt_digest_hex(v):
    return None if v is None else digest_hex(v)


def literal(*allowed):
    def parse(v):
        # type check first so True never passes as 1 and "2" never passes as 2
        if not any(type(v) is type(a) and v == a for a in allowed):
            raise FieldError(f"must be one of {list(allowed)!r}, got {v!r}")
        return v
    return parse


def opt_literal(*allowed):
    inner = literal(*allowed)
    return lambda v: None if v is None else inner(v)


def strict_float(v):
    """StrictFloat with Gym's observed coercion: ints become floats; bool/str rejected;
    non-finite rejected (allow_inf_nan=False)."""
    if type(v) is float:
        out = v
    elif type(v) is int:
        try:
            out = float(v)
        except OverflowError:
            raise FieldError("integer is too large for a float") from None
    else:
        raise FieldError(f"expected a number, got {type(v).__name__}")
    if not math.isfinite(out):
        raise FieldError("must be a finite number")
    return out


def opt_strict_float(v):
    return None if v is None else strict_float(v)


def lax_float(v):
    """pydantic's lax float: also bool and numeric strings; never NaN/inf."""
    if type(v) is bool:
        return float(v)
    if type(v) is str:
        try:
            out = float(v.strip())
        except ValueError:
            raise FieldError(f"cannot parse {v[:40]!r} as a number") from None
        if not math.isfinite(out):
            raise FieldError("must be a finite number")
        return out
    return strict_float(v)


def opt_lax_float(v):
    return None if v is None else lax_float(v)


_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def lax_bool(v):
    if type(v) is bool:
        return v
    if type(v) in (int, float) and v in (0, 1):  # pydantic's lax mode takes 0/1 and 0.0/1.0
        return bool(v)
    if type(v) is str and v.lower() in _TRUE | _FALSE:
        return v.lower() in _TRUE
    raise FieldError(f"expected a boolean, got {v!r}"[:120])


_U64_MAX = (1 << 64) - 1


def token_column(v):
    """list[StrictInt] -> uint64 array. Out-of-range values are kept as the original list so
    the model validators can report them in Gym's order ("must be non-negative" first, the
    u64 bound at digest time)."""
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype.kind not in "iu":
            raise FieldError("expected a 1-D integer array")
        if v.dtype.kind == "u" or v.size == 0 or int(v.min()) >= 0:
            return v.astype(np.uint64, copy=False)
        return [int(x) for x in v]
    if type(v) is not list:
        raise FieldError(f"expected a list of integers, got {type(v).__name__}")
    for i, x in enumerate(v):
        if type(x) is not int:
            raise FieldError(f"item {i}: expected an integer, got {type(x).__name__}")
    try:
        return np.array(v, dtype=np.uint64) if v else np.empty(0, np.uint64)
    except OverflowError:
        return list(v)


def float_column(v):
    """list[StrictFloat] -> float64 array (ints coerced, bool/str and non-finite rejected)."""
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype.kind != "f":
            raise FieldError("expected a 1-D float array")
        arr = v.astype(np.float64, copy=False)
    elif type(v) is list:
        for i, x in enumerate(v):
            if type(x) is not float and type(x) is not int:
                raise FieldError(f"item {i}: expected a number, got {type(x).__name__}")
        try:
            arr = np.array(v, dtype=np.float64) if v else np.empty(0, np.float64)
        except OverflowError:
            raise FieldError("integer is too large for a float") from None
    else:
        raise FieldError(f"expected a list of numbers, got {type(v).__name__}")
    if arr.size and not np.isfinite(arr).all():
        i = int(np.argmin(np.isfinite(arr)))
        raise FieldError(f"item {i}: must be a finite number")
    return arr


def int_list(v):
    if type(v) is not list:
        raise FieldError(f"expected a list of integers, got {type(v).__name__}")
    for i, x in enumerate(v):
        if type(x) is not int:
            raise FieldError(f"item {i}: expected an integer, got {type(x).__name__}")
    return list(v)


def str_list(v):
    if type(v) is not list:
        raise FieldError(f"expected a list of strings, got {type(v).__name__}")
    for i, x in enumerate(v):
        if type(x) is not str:
            raise FieldError(f"item {i}: expected a string, got {type(x).__name__}")
    return list(v)


def extras_dict(v):
    if v is None:
        return None
    if type(v) is not dict:
        raise FieldError(f"expected an object or null, got {type(v).__name__}")
    for k in v:
        if type(k) is not str:
            raise FieldError("keys must be strings")
    return v
