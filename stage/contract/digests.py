"""The four digests of the staging contract, byte-exact with NeMo Gym 0.7.0 (section 3)."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping

import numpy as np

from . import encoding as enc
from .routes import RouteEnvelope
from .constants import (
    CALL_DIGEST_DOMAIN,
    CAPTURE_MODES,
    CHAIN_HASH_DOMAIN,
    EXTRAS_DIGEST_DOMAIN,
    EXTRAS_DIGEST_VERSION,
    PREFIX_HASH_DOMAIN,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
)

_I64 = struct.Struct(">q")
_TWO_U64 = struct.Struct(">QQ")
_FOUR_U64 = struct.Struct(">QQQQ")
_VERSIONS = bytes((STAGING_SCHEMA_VERSION, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION))
_F64 = struct.Struct(">d")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


# --- cumulative (prefix) hash ------------------------------------------------------------

def hash_token_ids(token_ids) -> str:
    """``H(prefix-domain || u64(n) || n x u64be)``: the cumulative hash of a whole sequence."""
    image = enc.token_image(token_ids)
    h = hashlib.sha256(PREFIX_HASH_DOMAIN)
    h.update(enc.u64(len(image)))
    h.update(image)
    return h.hexdigest()


# --- chain hash ----------------------------------------------------------------------------

def compute_chain_hash(parent_chain_hash, token_ids_delta) -> str:
    """``H(chain-domain || marker || u64(n) || n x u64be)``; marker 0x00 for a root."""
    marker = b"\x00" if parent_chain_hash is None else (
        b"\x01" + enc.digest32(parent_chain_hash, "parent_chain_hash"))
    return chain_hash_of_image(marker, enc.token_image(token_ids_delta))


def chain_hash_of_image(marker: bytes, image) -> str:
    h = hashlib.sha256(CHAIN_HASH_DOMAIN)
    h.update(marker)
    h.update(enc.u64(len(image)))
    h.update(image)
    return h.hexdigest()


# --- extras digest -------------------------------------------------------------------------

def compute_extras_digest(extras) -> str:
    """``H(extras-domain || u8(1) || enc(extras))`` with Gym's typed, tag-prefixed encoding.

    A ``RouteEnvelope`` value is digested as the envelope string it stands for (Gym has the
    string there), streamed in pieces instead of written out."""
    if extras is not None and not isinstance(extras, Mapping):
        raise TypeError(f"extras must be a mapping or None, got {type(extras).__name__}")
    value = None if extras is None else dict(extras)
    h = hashlib.sha256(EXTRAS_DIGEST_DOMAIN)
    out: list[bytes] = [bytes((EXTRAS_DIGEST_VERSION,))]
    try:
        _encode_extras(value, out, h)
    except RecursionError:  # Gym lets RecursionError escape; a ValueError keeps callers simple
        raise ValueError("extras nesting is too deep") from None
    h.update(b"".join(out))
    return h.hexdigest()


def _encode_extras(value, out: list[bytes], h=None, depth: int = 0) -> None:
    # Exact type checks on purpose: subclasses, numpy scalars and tuples are not encodable.
    # Small items collect in ``out`` (joined once); a RouteEnvelope flushes them into the hash
    # ``h`` and streams (with no hash: written into ``out`` whole, the payload bytes).
    kind = type(value)
    if value is None:
        out.append(b"N")
    elif kind is bool:
        out.append(b"B\x01" if value else b"B\x00")
    elif kind is int:
        if not _I64_MIN <= value <= _I64_MAX:
            raise ValueError(f"extras integer is outside signed 64-bit range: {value}")
        out.append(b"I" + _I64.pack(value))
    elif kind is float:
        if not math.isfinite(value):
            raise ValueError(f"extras floats must be finite, got {value!r}")
        out.append(b"F" + _F64.pack(value))
    elif kind is str:
        out.append(b"S" + enc.text(value))
    elif kind is list:
        out.append(b"L" + enc.u64(len(value)))
        for item in value:
            _encode_extras(item, out, h, depth + 1)
    elif kind is dict:
        if any(type(k) is not str for k in value):
            raise TypeError("extras mappings must have string keys")
        items = sorted(((k.encode("utf-8"), v) for k, v in value.items()), key=lambda kv: kv[0])
        out.append(b"D" + enc.u64(len(items)))
        for key, item in items:
            out.append(enc.u64(len(key)) + key)
            _encode_extras(item, out, h, depth + 1)
    elif kind is RouteEnvelope:
        out.append(b"S" + enc.u64(value.text_length))   # text(): u64(byte length) || ASCII
        if h is None:
            out.extend(value.text_chunks())
            return
        h.update(b"".join(out))
        out.clear()
        for piece in value.text_chunks():
            h.update(piece)
    else:
        raise TypeError(f"extras contain unsupported value type {kind.__name__}")


# --- staged call digest --------------------------------------------------------------------

def _mask_ok(mask) -> bool:
    if isinstance(mask, np.ndarray):
        return bool(((mask == 0.0) | (mask == 1.0)).all())
    return all(m == 0.0 or m == 1.0 for m in mask)


def _carry_logprobs_ok(mask, logprobs) -> bool:
    if isinstance(mask, np.ndarray) and isinstance(logprobs, np.ndarray):
        n = min(len(mask), len(logprobs))
        return not bool(((mask[:n] == 0.0) & (logprobs[:n] != 0.0)).any())
    return not any(m == 0.0 and lp != 0.0 for m, lp in zip(mask, logprobs))


def check_staging_preconditions(*, schema_version, digest_version, extras_digest_version,
                                rollout_id, model_call_id, parent_call_id, mode, prev_len,
                                delta_len, cum_len, token_ids_delta, token_mask_delta,
                                generation_log_probs_delta, extras_digest,
                                columns_checked: bool = False) -> None:
    """Gym's precondition checks for the call digest, in Gym's order (section 3.5).

    ``columns_checked`` skips the two element-wise column checks when the caller has already
    run them over every row at once (the verifier's packed path)."""
    if type(schema_version) is not int or schema_version != STAGING_SCHEMA_VERSION:
        raise ValueError(f"unsupported staging schema version {schema_version}")
    if type(digest_version) is not int or digest_version != STAGING_DIGEST_VERSION:
        raise ValueError(f"unsupported staging digest version {digest_version}")
    if type(extras_digest_version) is not int or extras_digest_version != EXTRAS_DIGEST_VERSION:
        raise ValueError(f"unsupported extras digest version {extras_digest_version}")
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    if parent_call_id == "":
        raise ValueError("parent_call_id must be non-empty when present")
    if mode not in CAPTURE_MODES:
        raise ValueError(f"unsupported capture mode {mode!r}")
    if parent_call_id is None and (prev_len != 0 or mode != "text"):
        raise ValueError("a parentless call must be a text-mode root with prev_len == 0")
    if parent_call_id is not None and (prev_len == 0 or mode != "token_in"):
        raise ValueError("a child call must use token_in mode with prev_len > 0")
    if delta_len == 0:
        raise ValueError("a staged call delta must contain at least one token")
    if delta_len != len(token_ids_delta):
        raise ValueError(f"delta_len {delta_len} does not match {len(token_ids_delta)} token IDs")
    if not len(token_ids_delta) == len(token_mask_delta) == len(generation_log_probs_delta):
        raise ValueError("token IDs, masks, and log probabilities must have equal lengths")
    if not columns_checked and not _mask_ok(token_mask_delta):
        raise ValueError("token_mask_delta must contain only 0.0 or 1.0")
    if not columns_checked and not _carry_logprobs_ok(token_mask_delta, generation_log_probs_delta):
        raise ValueError("prompt-carry log probabilities must be 0.0")
    if cum_len != prev_len + delta_len:
        raise ValueError(f"cum_len {cum_len} does not equal prev_len + delta_len ({prev_len + delta_len})")
    if not enc.is_digest_hex(extras_digest):
        raise ValueError("extras_digest must be a lowercase SHA-256 hex digest")


def compute_staging_digest(*, schema_version, digest_version, extras_digest_version, rollout_id,
                           model_call_id, parent_call_id, mode, prev_len, delta_len, cum_len,
                           weight_version, token_ids_delta, token_mask_delta,
                           generation_log_probs_delta, extras_digest, chain_hash,
                           cumulative_hash) -> str:
    """The staged call digest (Gym section 3.5), stored as ``digest``."""
    fields = dict(schema_version=schema_version, digest_version=digest_version,
                  extras_digest_version=extras_digest_version, rollout_id=rollout_id,
                  model_call_id=model_call_id, parent_call_id=parent_call_id, mode=mode,
                  prev_len=prev_len, delta_len=delta_len, cum_len=cum_len,
                  token_ids_delta=token_ids_delta, token_mask_delta=token_mask_delta,
                  generation_log_probs_delta=generation_log_probs_delta,
                  extras_digest=extras_digest)
    check_staging_preconditions(**fields)
    return staging_digest_from_image(
        rollout_id=rollout_id, model_call_id=model_call_id, parent_call_id=parent_call_id,
        mode=mode, prev_len=prev_len, delta_len=delta_len, cum_len=cum_len,
        weight_version=weight_version, token_image=lambda: enc.token_image(token_ids_delta),
        mask_image=lambda: enc.f32_image(token_mask_delta, "token_mask_delta"),
        logprob_image=lambda: enc.f32_image(generation_log_probs_delta, "generation_log_probs_delta"),
        extras_digest=extras_digest, chain_hash=chain_hash, cumulative_hash=cumulative_hash)


def staging_digest_from_image(*, rollout_id, model_call_id, parent_call_id, mode, prev_len,
                              delta_len, cum_len, weight_version, token_image, mask_image,
                              logprob_image, extras_digest, chain_hash, cumulative_hash) -> str:
    """Write the payload in Gym's order; encoding errors surface lazily in that order.

    The three column images are zero-argument callables, evaluated in payload order, so the
    verifier can pass images it already computed (and reuse the token image for the chain and
    cumulative hashes).
    """
    texts = (_VERSIONS, enc.text(rollout_id), enc.text(model_call_id),
             enc.opt_text(parent_call_id), enc.text(mode))   # payload order: texts first
    lengths = (prev_len, delta_len, cum_len, weight_version)
    if all(type(v) is int and 0 <= v <= enc.U64_MAX for v in lengths):
        numbers = _FOUR_U64.pack(*lengths)
    else:  # reports the first bad field by name, in payload order
        numbers = (enc.uint(prev_len, "prev_len") + enc.uint(delta_len, "delta_len")
                   + enc.uint(cum_len, "cum_len") + enc.uint(weight_version, "weight_version"))
    head = b"".join((*texts, numbers))
    image = token_image()
    n = len(image)
    h = hashlib.sha256(CALL_DIGEST_DOMAIN)
    h.update(head + _TWO_U64.pack(8 + 8 * n, n))
    h.update(image)
    mask = mask_image()
    h.update(_TWO_U64.pack(8 + 4 * len(mask), len(mask)))
    h.update(mask)
    lps = logprob_image()
    h.update(_TWO_U64.pack(8 + 4 * len(lps), len(lps)))
    h.update(lps)
    h.update(enc.digest32(extras_digest, "extras_digest")
             + b"\x01" + enc.digest32(chain_hash, "chain_hash")
             + b"\x01" + enc.digest32(cumulative_hash, "cumulative_hash"))
    return h.hexdigest()
