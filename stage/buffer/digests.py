"""What a spilled staged call keeps of its content for the duplicate check: digests, not bytes.

While a staged call is held in memory, a second record under its staging key is compared with
it field by field and tensor by tensor (stage.buffer.duplicates). Once its record is spilled
(stage.buffer.spill) the payload is gone from memory, and so must be every large value its
fingerprint referenced (media and top-k columns, long texts): each is replaced by a SHA-256
digest of the value, and each token and route tensor by a ``TensorDigest``. A second copy is
then compared with the digests and gets the same answer as with the values themselves:
``ValueDigest`` follows ``duplicates._same`` (types, NaN equal to NaN, dict keys in any order),
``TensorDigest`` follows ``duplicates._same_tensor`` (the same bytes in the same dtype, or the
same values in another dtype).
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any

import numpy as np

# Values at most this many characters stay as they are in a spilled fingerprint (the conflict
# text quotes them); longer texts, bytes and containers become digests.
KEPT_TEXT_CHARS = 64


class ValueDigest(bytes):
    """SHA-256 of a value's structure (``value_digest``); equal digests, equal values."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<sha256 {self.hex()[:16]}>"


def value_digest(value: Any) -> ValueDigest:
    if isinstance(value, ValueDigest):
        return value
    h = hashlib.sha256()
    _feed(h, value)
    return ValueDigest(h.digest())


def _feed(h, value) -> None:
    # Tagged and length-prefixed, so that no two structures share an encoding.
    if value is None:
        h.update(b"n")
    elif isinstance(value, bool):
        h.update(b"T" if value else b"F")
    elif isinstance(value, int) and type(value) is int:
        text = str(value).encode()
        h.update(b"i%d:" % len(text) + text)
    elif isinstance(value, float) and type(value) is float:
        # _same: NaN equals NaN; 0.0 == -0.0
        h.update(b"f" + (b"nan" if math.isnan(value) else struct.pack("<d", value + 0.0)))
    elif type(value) in (str, bytes, bytearray):
        data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
        h.update({str: b"s", bytes: b"y", bytearray: b"a"}[type(value)] + b"%d:" % len(data))
        h.update(data)
    elif isinstance(value, dict):
        h.update(b"d%d:" % len(value))
        for key, item in sorted(((value_digest(k), v) for k, v in value.items()), key=lambda kv: kv[0]):
            h.update(key)
            h.update(value_digest(item))
    elif isinstance(value, (list, tuple)):
        h.update(b"l%d:" % len(value))
        for item in value:
            _feed(h, item)
    else:   # not what an Avro decoder returns; compared as its type and repr
        text = f"{type(value).__qualname__}:{value!r}".encode("utf-8", "surrogatepass")
        h.update(b"o%d:" % len(text) + text)


def spilled_fingerprint(fingerprint: tuple) -> tuple:
    """``fingerprint`` (field names, values) with every value but a number, a flag, None or a
    short text replaced by its digest."""
    if not fingerprint:
        return fingerprint
    names, values = fingerprint
    return names, tuple(v if _kept(v) else value_digest(v) for v in values)


def _kept(value) -> bool:
    if value is None or type(value) in (bool, int, float):
        return True
    return type(value) is str and len(value) <= KEPT_TEXT_CHARS


class TensorDigest:
    """A packed tensor (``{"dtype", "shape", "data"}``) as digests: of its bytes, and of its
    values with every NaN alike and -0.0 as 0.0 (another copy in another dtype is compared by
    value, as ``np.array_equal(..., equal_nan=True)`` does)."""

    __slots__ = ("dtype", "shape", "raw", "values")

    def __init__(self, dtype: str, shape, raw: bytes, values: bytes) -> None:
        self.dtype, self.shape, self.raw, self.values = dtype, shape, raw, values

    @classmethod
    def of(cls, tensor) -> "TensorDigest | ValueDigest":
        """The digest of ``tensor``; a value that is no packed tensor numpy can read is digested
        as a value (compared exactly, as ``_same_tensor`` compares it)."""
        array = _array(tensor)
        if array is None:
            return value_digest(tensor)
        raw = hashlib.sha256(tensor["data"]).digest()
        return cls(tensor["dtype"], tensor.get("shape"), raw, _values_sha(array) or raw)

    def matches(self, tensor) -> bool:
        """Whether ``tensor`` holds what the digested tensor held (``_same_tensor``)."""
        if not isinstance(tensor, dict) or tensor.get("shape") != self.shape:
            return False
        if tensor.get("dtype") == self.dtype:
            data = tensor.get("data")
            return isinstance(data, (bytes, bytearray)) and hashlib.sha256(data).digest() == self.raw
        theirs = _array(tensor)
        if theirs is None:
            return False
        ours = np.dtype(self.dtype)
        with np.errstate(all="ignore"):
            converted = theirs.astype(ours)
            floats = ours.kind == "f" or theirs.dtype.kind == "f"
            if not np.array_equal(converted.astype(theirs.dtype), theirs, equal_nan=floats):
                return False   # a value our dtype cannot hold: not one of ours
        return (_values_sha(converted) or hashlib.sha256(converted.tobytes()).digest()) == self.values


def _array(tensor) -> np.ndarray | None:
    if not isinstance(tensor, dict) or not isinstance(tensor.get("data"), (bytes, bytearray)):
        return None
    try:
        return np.frombuffer(tensor["data"], dtype=np.dtype(tensor["dtype"]))
    except (TypeError, ValueError, KeyError):
        return None


def _values_sha(array: np.ndarray) -> bytes | None:
    """SHA-256 of a float array's values made canonical (None for other kinds: their bytes are
    their values)."""
    if array.dtype.kind != "f":
        return None
    canonical = array + array.dtype.type(0)      # -0.0 -> 0.0 (a copy)
    canonical[np.isnan(canonical)] = np.nan
    return hashlib.sha256(canonical.tobytes()).digest()
