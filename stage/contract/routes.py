"""Routed-experts payloads: the ``nrlre1`` envelope, the legacy nested list, span classes.

Gym section 6. Decoded values are numpy arrays ``[tokens, layers, topk]``, not nested lists.
``RouteEnvelope`` is an envelope not written out yet (dtype, shape, raw bytes): the extras digest
streams it (``compute_extras_digest`` accepts it wherever Gym has the envelope string), so
neither a producer nor a verifier has to build the base64 string of a many-megabyte fragment.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pybase64

from .constants import MISSING_ROUTE_SENTINEL, ROUTED_EXPERTS_MAGIC

__all__ = [
    "RouteEnvelope", "RoutedExpertsFragment", "encode_routed_experts", "decode_routed_experts",
    "routed_experts_token_count", "classify_route_span", "MISSING_ROUTE_SENTINEL",
]

_NUMPY_DTYPES = {"int8": np.dtype("<i1"), "int16": np.dtype("<i2"), "int32": np.dtype("<i4")}


@dataclass(frozen=True, eq=False)
class RoutedExpertsFragment:
    values: np.ndarray  # [tokens, layers, topk]
    dtype: str          # "int8" | "int16" | "int32" | "legacy-int"
    num_layers: int
    topk: int

    @property
    def num_tokens(self) -> int:
        return int(self.values.shape[0])


def _check_dtype(dtype) -> np.dtype:
    if dtype not in _NUMPY_DTYPES:
        raise ValueError(f"unsupported routed_experts dtype {dtype!r}")
    return _NUMPY_DTYPES[dtype]


def encode_routed_experts(values, dtype: str = "int16") -> str:
    """``"nrlre1:<dtype>:<T>x<L>x<K>:<base64 little-endian signed values>"``."""
    return RouteEnvelope.of(values, dtype).text()


# base64 works on 3-byte groups: chunks of a multiple of 3 encode to the same text, piecewise.
# The route digests hash base64 text, so encoding it is half the integrity work: pybase64's SIMD
# encoder gives the same text as binascii at 30-60x its speed (bench wire/fetch/finalize).
_B64_CHUNK = 3 << 18


@dataclass(frozen=True, eq=False)
class RouteEnvelope:
    """An ``nrlre1`` envelope as its parts: ``text()`` is the string Gym digests and stages."""

    dtype: str                       # int8 | int16 | int32
    shape: tuple[int, int, int]      # T, L, K (all > 0)
    raw: memoryview                  # the T*L*K values, C order, little-endian, as bytes

    @classmethod
    def of(cls, values, dtype: str = "int16") -> "RouteEnvelope":
        """Validated as ``encode_routed_experts`` validates (same errors); no copy when
        ``values`` is already a C-contiguous little-endian array of ``dtype``."""
        np_dtype = _check_dtype(dtype)
        array = _as_route_array(values)
        if not np.can_cast(array.dtype, np_dtype, "safe"):  # a wider type: check every value
            info = np.iinfo(np_dtype)
            if array.size and (int(array.min()) < info.min or int(array.max()) > info.max):
                raise ValueError(f"routed_experts values do not fit dtype {dtype!r}")
        packed = np.ascontiguousarray(array, dtype=np_dtype)
        t, l, k = packed.shape
        return cls(dtype, (int(t), int(l), int(k)), memoryview(packed).cast("B"))

    @property
    def header(self) -> bytes:
        t, l, k = self.shape
        return f"{ROUTED_EXPERTS_MAGIC}:{self.dtype}:{t}x{l}x{k}:".encode("ascii")

    @property
    def text_length(self) -> int:
        """Characters (= UTF-8 bytes: all ASCII) of ``text()``."""
        return len(self.header) + 4 * ((len(self.raw) + 2) // 3)

    def text_chunks(self) -> Iterator[bytes]:
        """``text()`` as ASCII bytes, in pieces (the header, then base64 of successive
        multiple-of-3 slices of the raw bytes, which concatenate to the base64 of all)."""
        yield self.header
        raw, b64 = self.raw, pybase64.b64encode
        for start in range(0, len(raw), _B64_CHUNK):
            yield b64(raw[start:start + _B64_CHUNK])

    def text(self) -> str:
        return b"".join(self.text_chunks()).decode("ascii")


def _as_route_array(values) -> np.ndarray:
    if isinstance(values, np.ndarray):
        if values.ndim != 3 or values.dtype.kind not in "iu" or 0 in values.shape:
            raise ValueError("routed_experts must be a non-empty [tokens, layers, topk] integer array")
        return values
    return _legacy_values(values)


def _legacy_values(payload) -> np.ndarray:
    """Validate a legacy nested list (Gym's rules and messages) and pack it."""
    if type(payload) is not list:
        raise ValueError("legacy routed_experts must be a nested list")
    if not payload:
        raise ValueError("routed_experts must contain at least one token row")
    layers = topk = None
    for row in payload:
        if type(row) is not list or not row:
            raise ValueError("each routed_experts token row must contain layers")
        if layers is None:
            layers = len(row)
        elif len(row) != layers:
            raise ValueError("routed_experts layer count must be constant")
        for layer in row:
            if type(layer) is not list or not layer:
                raise ValueError("each routed_experts layer row must contain experts")
            if topk is None:
                topk = len(layer)
            elif len(layer) != topk:
                raise ValueError("routed_experts top-k width must be constant")
            for value in layer:
                if type(value) is not int:
                    raise ValueError("routed_experts values must be exact integers")
    try:
        return np.array(payload, dtype=np.int64)
    except OverflowError:
        raise ValueError("routed_experts values do not fit a signed 64-bit integer") from None


def decode_routed_experts(payload) -> RoutedExpertsFragment:
    if not isinstance(payload, str):
        values = _legacy_values(payload)
        return RoutedExpertsFragment(values, "legacy-int", values.shape[1], values.shape[2])
    dtype, (t, l, k), body = _parse_header(payload)
    np_dtype = _NUMPY_DTYPES[dtype]
    want = t * l * k * np_dtype.itemsize
    # No allocation beyond the input: the decoded body is 3/4 of a string already in memory,
    # and the array is built only when its byte length equals the declared shape.
    try:
        raw = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("routed_experts envelope contains invalid base64") from None
    if len(raw) != want:
        raise ValueError(f"routed_experts byte length does not match its declared shape ({len(raw)} != {want})")
    values = np.frombuffer(raw, dtype=np_dtype).reshape(t, l, k)
    return RoutedExpertsFragment(values, dtype, l, k)


def _parse_header(payload: str):
    parts = payload.split(":", 3)
    if len(parts) != 4 or parts[0] != ROUTED_EXPERTS_MAGIC:
        raise ValueError("unsupported routed_experts envelope; expected nrlre1")
    _check_dtype(parts[1])
    dims = parts[2].split("x")
    if len(dims) != 3:
        raise ValueError("routed_experts envelope shape must have three dimensions")
    try:
        # Python int() semantics on purpose (Gym accepts spaces, '+' and '_'); Python's own
        # int-string digit limit bounds the work on a hostile header.
        shape = tuple(int(d) for d in dims)
    except ValueError:
        raise ValueError("routed_experts envelope shape must contain integers") from None
    if any(d <= 0 for d in shape):
        raise ValueError("routed_experts envelope dimensions must be positive")
    return parts[1], shape, parts[3]


def routed_experts_token_count(payload) -> int:
    """Number of token rows without decoding the body (header only for an envelope)."""
    if isinstance(payload, str):
        _, (t, _l, _k), _ = _parse_header(payload)
        return t
    if type(payload) is list:
        return len(payload)
    raise ValueError("legacy routed_experts must be a non-empty nested list")


def classify_route_span(*, carry_len, generation_len, staged_route_len) -> str:
    for name, value in (("carry_len", carry_len), ("generation_len", generation_len),
                        ("staged_route_len", staged_route_len)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if staged_route_len > 0 and staged_route_len == carry_len + generation_len:
        return "full"
    if staged_route_len > 0 and 0 < generation_len <= staged_route_len:
        return "tail"
    return "sentinel"
