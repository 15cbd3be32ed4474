"""Byte encodings of the staging contract (Gym section 3.1).

Token columns are numpy arrays on the hot path; Python lists (Gym's own types) are accepted
and held to Gym's exact-type rules. Every encoder returns bytes-like objects that hashlib can
consume without another copy.
"""

from __future__ import annotations

import re
import struct

import numpy as np

U64_MAX = (1 << 64) - 1
_U64 = struct.Struct(">Q")
_BE_U64 = np.dtype(">u8")
_BE_F32 = np.dtype(">f4")


def uint(value, field: str) -> bytes:
    if type(value) is not int or value < 0 or value > U64_MAX:
        raise ValueError(f"{field} must be an unsigned 64-bit integer, got {value!r}")
    return _U64.pack(value)


def u64(n: int) -> bytes:
    """Length prefix for a value already known to be in range."""
    return _U64.pack(n)


def text(value) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    raw = value.encode("utf-8")  # lone surrogates raise UnicodeEncodeError (a ValueError)
    return _U64.pack(len(raw)) + raw


def opt_text(value) -> bytes:
    return b"\x00" if value is None else b"\x01" + text(value)


def digest32(value, field: str) -> bytes:
    if not is_digest_hex(value):
        raise ValueError(f"{field} must be a lowercase SHA-256 hex digest")
    return bytes.fromhex(value)


_DIGEST_HEX = re.compile(r"[0-9a-f]{64}")


def is_digest_hex(value) -> bool:
    # fullmatch, not match + "$": a trailing newline must not pass (Gym's Rust regex rejects it)
    return type(value) is str and _DIGEST_HEX.fullmatch(value) is not None


def token_image(ids, field: str = "token_id"):
    """The n x u64be image of a token column (no count prefix).

    Accepts an integer numpy array or a list of exact Python ints. Raises Gym's
    ``"<field> must be an unsigned 64-bit integer, got <repr>"`` for the first bad element.
    """
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind == "u":
            return ids.astype(_BE_U64)
        if ids.dtype.kind == "i":
            if ids.size and int(ids.min()) < 0:
                bad = int(ids[np.argmax(ids < 0)])
                raise ValueError(f"{field} must be an unsigned 64-bit integer, got {bad!r}")
            return ids.astype(_BE_U64)
        bad = ids.flat[0].item() if ids.size else None
        raise ValueError(f"{field} must be an unsigned 64-bit integer, got {bad!r}")
    for x in ids:
        if type(x) is not int or x < 0 or x > U64_MAX:
            raise ValueError(f"{field} must be an unsigned 64-bit integer, got {x!r}")
    return np.array(ids, dtype=np.uint64).astype(_BE_U64) if ids else np.empty(0, _BE_U64)


def f32_image(values, field: str):
    """The n x f32be image of a float column (no count prefix).

    Doubles round to binary32 by round-to-nearest-even with the sign of zero kept, exactly as
    a C ``(float)`` cast does; a finite value that rounds to infinity is rejected.
    """
    if isinstance(values, np.ndarray):
        if values.dtype.kind != "f":
            bad = values.flat[0].item() if values.size else None
            raise ValueError(f"{field} values must be finite Python floats, got {bad!r}")
        finite = np.isfinite(values)
        if not finite.all():
            bad = float(values[np.argmin(finite)])
            raise ValueError(f"{field} values must be finite Python floats, got {bad!r}")
        arr = values
    else:
        for x in values:
            if type(x) is not float or x != x or x in (float("inf"), float("-inf")):
                raise ValueError(f"{field} values must be finite Python floats, got {x!r}")
        arr = np.array(values, dtype=np.float64)
    with np.errstate(over="ignore"):
        image = arr.astype(_BE_F32)
    if image.size and not np.isfinite(image).all():
        bad = float(arr[np.argmin(np.isfinite(image))])
        raise ValueError(f"{field} value cannot be represented as float32: {bad!r}")
    return image
