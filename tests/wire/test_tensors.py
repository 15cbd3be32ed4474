"""PackedTensor: layout, zero-copy read-only views, and every validation message."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stage.wire import STORAGE_DTYPES, WireError, pack_tensor, unpack_tensor, unpack_torch

NUMPY_DTYPES = [d for d in STORAGE_DTYPES if d != "bfloat16"]


@pytest.mark.parametrize("name", NUMPY_DTYPES)
def test_numpy_round_trip_every_dtype(name):
    src = (np.arange(24) % 2 == 1) if name == "bool" else np.arange(24).astype(name)
    src = src.reshape(2, 3, 4)
    packed = pack_tensor(src)
    assert packed["dtype"] == name and packed["shape"] == [2, 3, 4]
    assert packed["data"] == src.astype(STORAGE_DTYPES[name]).tobytes()
    out = unpack_tensor(packed)
    np.testing.assert_array_equal(out, src)
    assert out.dtype == STORAGE_DTYPES[name]
    assert torch.equal(unpack_torch(packed), torch.from_numpy(src.copy()))


def test_layout_is_little_endian_c_order():
    src = np.arange(6, dtype=">i4").reshape(2, 3).T  # big-endian and Fortran-ordered
    packed = pack_tensor(src)
    assert packed["shape"] == [3, 2]
    assert packed["data"][:8] == (0).to_bytes(4, "little") + (3).to_bytes(4, "little")
    np.testing.assert_array_equal(unpack_tensor(packed), src)


def test_view_is_zero_copy_and_read_only():
    packed = pack_tensor(np.arange(10, dtype=np.int64))
    out = unpack_tensor(packed)
    assert np.shares_memory(out, np.frombuffer(packed["data"], np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        out[0] = 1
    writable = dict(packed, data=bytearray(packed["data"]))
    assert not unpack_tensor(writable).flags.writeable


def test_bfloat16_from_torch():
    src = torch.tensor([[1.5, -2.0, 3.140625]], dtype=torch.bfloat16)
    packed = pack_tensor(src)
    assert packed["dtype"] == "bfloat16" and packed["shape"] == [1, 3]
    bits = unpack_tensor(packed)
    assert bits.dtype == np.dtype("<u2")
    assert bits.tolist() == [[v & 0xFFFF for v in src.view(torch.int16).flatten().tolist()]]
    back = unpack_torch(packed)
    assert back.dtype == torch.bfloat16 and torch.equal(back, src)


def test_unpack_torch_is_a_private_copy():
    packed = pack_tensor(np.arange(4, dtype=np.int8))
    before = bytes(packed["data"])
    t = unpack_torch(packed)
    t += 1  # must never write into the decoded (immutable) bytes object
    assert packed["data"] == before


def test_scalar_and_empty_shapes():
    for src in (np.array(7, np.int32), np.zeros((0, 5), np.float32), np.zeros((2, 0, 2**40), np.int8)):
        out = unpack_tensor(pack_tensor(src))
        assert out.shape == src.shape


@pytest.mark.parametrize("value, message", [
    (np.zeros(2, np.complex64), r"x: dtype complex64 is not a wire dtype"),
    (np.zeros(2, np.uint16), r"x: dtype uint16 is not a wire dtype"),
    (torch.zeros(2, dtype=torch.complex64), r"x: cannot pack torch|x: dtype complex64"),
    ([1, 2], r"x: expected a numpy array or torch tensor, got list"),
])
def test_pack_refuses(value, message):
    with pytest.raises(WireError, match=message):
        pack_tensor(value, field="x")


GOOD = {"dtype": "int16", "shape": [2, 3], "data": bytes(12)}


@pytest.mark.parametrize("obj, kwargs, message", [
    ([1], {}, r"^f: expected a PackedTensor record, got list$"),
    ({"dtype": "int16", "shape": [1]}, {}, r"^f.data: missing$"),
    (dict(GOOD, dtype="complex64"), {}, r"^f.dtype: unknown dtype 'complex64'; wire dtypes: "),
    (dict(GOOD, dtype=None), {}, r"^f.dtype: unknown dtype None"),
    (GOOD, {"expect_dtypes": {"int8", "int32"}},
     r"^f.dtype: dtype int16 not allowed here; expected one of \['int32', 'int8'\]$"),
    (dict(GOOD, shape=6), {}, r"^f.shape: expected a list of dims, got int$"),
    (dict(GOOD, shape=[1] * 33), {}, r"^f.shape: 33 dims exceeds the limit of 32$"),
    (GOOD, {"expect_ndim": 3}, r"^f.shape: expected 3 dims, got 2 \[2, 3\]$"),
    (dict(GOOD, shape=[2, 3.0]), {}, r"^f.shape\[1\]: dim must be an int, got float$"),
    (dict(GOOD, shape=[True, 3]), {}, r"^f.shape\[0\]: dim must be an int, got bool$"),
    (dict(GOOD, shape=[2, -3]), {}, r"^f.shape\[1\]: dim -3 is negative$"),
    (dict(GOOD, data="x" * 12), {}, r"^f.data: expected bytes, got str$"),
    (dict(GOOD, shape=[2**62, 4]), {}, r"^f.shape: shape \[4611686018427387904, 4\] of int16 is too large"),
    (dict(GOOD, shape=[0, 2**62, 4]), {}, r"^f.shape: .* too large to address$"),
    (GOOD, {"max_bytes": 8}, r"^f.data: 12 bytes exceeds max_bytes=8$"),
    (dict(GOOD, shape=[2**20, 2**20]), {"max_bytes": 2**30},
     r"^f.data: 2199023255552 bytes exceeds max_bytes=1073741824$"),
    (dict(GOOD, data=bytes(11)), {}, r"^f.data: 11 bytes, but shape \[2, 3\] of int16 needs 12$"),
    (dict(GOOD, data=bytes(13)), {}, r"^f.data: 13 bytes, but shape \[2, 3\] of int16 needs 12$"),
    (dict(GOOD, shape=[2**40]), {}, r"^f.data: 12 bytes, but shape \[1099511627776\] of int16 needs"),
    ({"dtype": "bool", "shape": [2], "data": b"\x01\x02"}, {}, r"^f.data: bool bytes must be 0 or 1$"),
])
def test_unpack_validation_messages(obj, kwargs, message):
    with pytest.raises(WireError, match=message) as info:
        unpack_tensor(obj, field="f", **kwargs)
    assert info.value.field.startswith("f")
    with pytest.raises(WireError, match=message):  # unpack_torch runs the same checks first
        unpack_torch(obj, field="f", **kwargs)


def test_default_field_name():
    with pytest.raises(WireError, match=r"^PackedTensor.shape\[0\]: dim -1 is negative$"):
        unpack_tensor({"dtype": "int8", "shape": [-1], "data": b""})


def test_accepted_with_constraints():
    out = unpack_tensor(GOOD, expect_dtypes=("int16",), expect_ndim=2, max_bytes=12)
    assert out.shape == (2, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_unpack_torch_to_cuda():
    src = torch.randn(3, 4).to(torch.bfloat16)
    out = unpack_torch(pack_tensor(src), device="cuda")
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16
    assert torch.equal(out.cpu(), src)
    routes = np.full((5, 48, 8), -1, np.int16)
    assert torch.equal(unpack_torch(pack_tensor(routes), device="cuda").cpu(), torch.from_numpy(routes))


def test_a_packed_view_holds_the_same_bytes_as_a_packed_copy():
    """pack_tensor(copy=False) (rows encoded at once) must say what pack_tensor says: empty,
    0-d, non-contiguous, big-endian and bfloat16 arrays included."""
    import numpy as np
    import torch

    from stage.wire import pack_tensor
    cases = [np.zeros((0, 4), np.float32), np.array(3.0, np.float32), np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2],
             np.arange(5, dtype=">i8"), torch.zeros((0, 3), dtype=torch.bfloat16),
             torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16).t()]
    for array in cases:
        view, copy = pack_tensor(array, copy=False), pack_tensor(array)
        assert bytes(view["data"]) == copy["data"] and view["shape"] == copy["shape"]
        assert view["dtype"] == copy["dtype"]
