"""Independent reference encodings of the staging digests, written from the spec (section 3)
with ``struct``/``hashlib`` only. The tests compare the package against these; nothing here
imports ``stage``.
"""

from __future__ import annotations

import hashlib
import math
import struct

U64_MAX = (1 << 64) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


def u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def text(s: str) -> bytes:
    raw = s.encode("utf-8")
    return u64(len(raw)) + raw


def opt_text(s) -> bytes:
    return b"\x00" if s is None else b"\x01" + text(s)


def tokens(ids) -> bytes:
    return u64(len(ids)) + b"".join(u64(int(i)) for i in ids)


def f32s(xs) -> bytes:
    # struct's 'f' is a C (float) cast: round-to-nearest-even, sign of zero kept, and an
    # OverflowError when a finite double rounds to infinity.
    return u64(len(xs)) + b"".join(struct.pack(">f", float(x)) for x in xs)


def framed(b: bytes) -> bytes:
    return u64(len(b)) + b


def hash_token_ids(ids) -> str:
    return hashlib.sha256(b"nemo-gym-staging-prefix-v2" + tokens(ids)).hexdigest()


def chain_hash(parent, ids) -> str:
    marker = b"\x00" if parent is None else b"\x01" + bytes.fromhex(parent)
    return hashlib.sha256(b"nemo-gym-staging-chain-v1" + marker + tokens(ids)).hexdigest()


def staging_digest(*, rollout_id, model_call_id, parent_call_id, mode, prev_len, delta_len,
                   cum_len, weight_version, token_ids_delta, token_mask_delta,
                   generation_log_probs_delta, extras_digest, chain_hash, cumulative_hash,
                   **_versions) -> str:
    payload = (
        bytes((2, 2, 1))
        + text(rollout_id) + text(model_call_id) + opt_text(parent_call_id) + text(mode)
        + u64(prev_len) + u64(delta_len) + u64(cum_len) + u64(weight_version)
        + framed(tokens(token_ids_delta))
        + framed(f32s(token_mask_delta))
        + framed(f32s(generation_log_probs_delta))
        + bytes.fromhex(extras_digest)
        + b"\x01" + bytes.fromhex(chain_hash)
        + b"\x01" + bytes.fromhex(cumulative_hash)
    )
    return hashlib.sha256(b"nemo-gym-staging-call-v2" + payload).hexdigest()


def _enc(v) -> bytes:
    t = type(v)
    if v is None:
        return b"N"
    if t is bool:
        return b"B\x01" if v else b"B\x00"
    if t is int:
        if not I64_MIN <= v <= I64_MAX:
            raise ValueError("int out of range")
        return b"I" + struct.pack(">q", v)
    if t is float:
        if not math.isfinite(v):
            raise ValueError("non-finite")
        return b"F" + struct.pack(">d", v)
    if t is str:
        return b"S" + text(v)
    if t is list:
        return b"L" + u64(len(v)) + b"".join(_enc(x) for x in v)
    if t is dict:
        if any(type(k) is not str for k in v):
            raise TypeError("non-str key")
        items = sorted(((k.encode("utf-8"), x) for k, x in v.items()), key=lambda kv: kv[0])
        return b"D" + u64(len(items)) + b"".join(u64(len(k)) + k + _enc(x) for k, x in items)
    raise TypeError(t.__name__)


def extras_digest(extras) -> str:
    return hashlib.sha256(b"nemo-gym-staging-extras-v1" + b"\x01" + _enc(extras)).hexdigest()


def f32_bits(x: float) -> bytes:
    return struct.pack(">f", x)
