"""PackedTensor: a dense array as little-endian C-order bytes plus dtype and shape.

Token columns travel packed because Avro arrays of numbers decode element by element into
Python ints, while packed bytes decode in one copy and can be hashed as they are.
``unpack_tensor`` treats the record as untrusted: every check runs on the three fields before
any array exists, and the result is a zero-copy, read-only view of the decoded bytes.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

from .errors import WireError

# Wire dtype name -> little-endian storage dtype. bfloat16 has no numpy dtype: its raw
# 16-bit patterns are exposed as uint16 (``unpack_torch`` reinterprets them).
STORAGE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code) for name, code in (
        ("bool", "?"), ("int8", "i1"), ("uint8", "u1"), ("int16", "<i2"), ("int32", "<i4"),
        ("uint32", "<u4"), ("int64", "<i8"), ("uint64", "<u8"), ("float16", "<f2"),
        ("bfloat16", "<u2"), ("float32", "<f4"), ("float64", "<f8"))
}
_NUMPY_NAMES = {d.newbyteorder("="): n for n, d in STORAGE_DTYPES.items() if n != "bfloat16"}
_TORCH_DTYPES = {
    "bool": torch.bool, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "int32": torch.int32, "uint32": torch.uint32, "int64": torch.int64, "uint64": torch.uint64,
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64,
}
MAX_NDIM = 32  # numpy 1.x's limit; the contract's tensors have at most 3 dims
_INTP_MAX = np.iinfo(np.intp).max


def _byte_view(array: np.ndarray):
    """The array's bytes in C order as a flat view (a copy only if it is not C-contiguous)."""
    if array.size == 0:
        return b""
    return memoryview(np.ascontiguousarray(array).reshape(-1)).cast("B")


def pack_tensor(array: np.ndarray | torch.Tensor, *, field: str | None = None,
                copy: bool = True) -> dict:
    """PackedTensor dict for ``array`` (one copy into little-endian C-order bytes).
    ``copy=False``: ``data`` is a flat byte view of the (C-contiguous, little-endian) array
    instead, no copy where none is needed; for a record encoded at once (AvroCodec.encode
    splices a view in), never one that outlives the array's use."""
    if isinstance(array, torch.Tensor):
        t = array.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bit patterns
            bits = t.view(torch.int16).numpy().astype("<i2", copy=False)
            data = bits.tobytes() if copy else _byte_view(bits)
            return {"dtype": "bfloat16", "shape": list(t.shape), "data": data}
        try:
            array = t.numpy()
        except (TypeError, RuntimeError) as e:
            raise WireError(f"cannot pack torch {t.dtype}: {e}", field=field) from None
    if not isinstance(array, np.ndarray):
        raise WireError(f"expected a numpy array or torch tensor, got {type(array).__name__}",
                        field=field)
    name = _NUMPY_NAMES.get(array.dtype.newbyteorder("="))
    if name is None:
        hint = " (bfloat16 must come as a torch tensor)" if "bfloat16" in str(array.dtype) else ""
        raise WireError(f"dtype {array.dtype} is not a wire dtype {sorted(STORAGE_DTYPES)}{hint}",
                        field=field)
    stored = array.astype(STORAGE_DTYPES[name], copy=False)
    data = stored.tobytes(order="C") if copy else _byte_view(stored)
    return {"dtype": name, "shape": [int(d) for d in array.shape], "data": data}


def unpack_tensor(obj: Any, *, field: str | None = None,
                  expect_dtypes: Collection[str] | None = None, expect_ndim: int | None = None,
                  max_bytes: int | None = None) -> np.ndarray:
    """Validated read-only view of a PackedTensor (bfloat16 comes back as its uint16 bits)."""
    where = field or "PackedTensor"
    if not isinstance(obj, Mapping):
        raise WireError(f"expected a PackedTensor record, got {type(obj).__name__}", field=where)
    for key in ("dtype", "shape", "data"):
        if key not in obj:
            raise WireError("missing", field=f"{where}.{key}")
    name, shape, data = obj["dtype"], obj["shape"], obj["data"]

    if not isinstance(name, str) or name not in STORAGE_DTYPES:
        raise WireError(f"unknown dtype {name!r}; wire dtypes: {list(STORAGE_DTYPES)}",
                        field=f"{where}.dtype")
    if expect_dtypes is not None and name not in expect_dtypes:
        raise WireError(f"dtype {name} not allowed here; expected one of {sorted(expect_dtypes)}",
                        field=f"{where}.dtype")
    if not isinstance(shape, (list, tuple)):
        raise WireError(f"expected a list of dims, got {type(shape).__name__}",
                        field=f"{where}.shape")
    if len(shape) > MAX_NDIM:
        raise WireError(f"{len(shape)} dims exceeds the limit of {MAX_NDIM}", field=f"{where}.shape")
    if expect_ndim is not None and len(shape) != expect_ndim:
        raise WireError(f"expected {expect_ndim} dims, got {len(shape)} {list(shape)}",
                        field=f"{where}.shape")
    for i, dim in enumerate(shape):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise WireError(f"dim must be an int, got {type(dim).__name__}",
                            field=f"{where}.shape[{i}]")
        if dim < 0:
            raise WireError(f"dim {dim} is negative", field=f"{where}.shape[{i}]")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}", field=f"{where}.data")

    itemsize = STORAGE_DTYPES[name].itemsize
    nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
    # Python ints cannot overflow; numpy additionally needs the byte size of the non-zero dims
    # to fit in intp even when a zero dim makes the array empty.
    if math.prod(d for d in shape if d) * itemsize > _INTP_MAX:
        raise WireError(f"shape {list(shape)} of {name} is too large to address", field=f"{where}.shape")
    expected = math.prod(shape) * itemsize
    if max_bytes is not None and max(expected, nbytes) > max_bytes:
        raise WireError(f"{max(expected, nbytes)} bytes exceeds max_bytes={max_bytes}",
                        field=f"{where}.data")
    if nbytes != expected:
        raise WireError(f"{nbytes} bytes, but shape {list(shape)} of {name} needs {expected}",
                        field=f"{where}.data")

    array = np.frombuffer(data, dtype=STORAGE_DTYPES[name]).reshape(shape)
    array.flags.writeable = False  # frombuffer of a bytearray/memoryview would be writable
    if name == "bool" and array.size and array.view(np.uint8).max() > 1:
        raise WireError("bool bytes must be 0 or 1", field=f"{where}.data")
    return array


def unpack_torch(obj: Any, *, device: str | torch.device = "cpu", field: str | None = None,
                 expect_dtypes: Collection[str] | None = None, expect_ndim: int | None = None,
                 max_bytes: int | None = None) -> torch.Tensor:
    """Validated torch tensor (bfloat16 included) on ``device``; always a private copy, since
    torch has no read-only tensors and the decoded bytes object must never be mutated."""
    array = unpack_tensor(obj, field=field, expect_dtypes=expect_dtypes,
                          expect_ndim=expect_ndim, max_bytes=max_bytes)
    name = obj["dtype"]
    # Copy into a torch-owned buffer (torch.from_numpy of the read-only view would alias the
    # immutable bytes and warn); the one host copy, then at most one device transfer.
    storage = torch.uint16 if name == "bfloat16" else _TORCH_DTYPES[name]
    host = torch.empty(array.shape, dtype=storage)
    host.numpy()[...] = array
    if name == "bfloat16":
        host = host.view(torch.bfloat16)
    return host.to(device)
