"""All rows' token columns packed into contiguous arrays, checked and converted in one pass.

The verifier must check and hash every row; doing it per row costs a dozen numpy calls each
(~2 us apiece on 500-token deltas). Packing once turns that into a dozen calls per rollout.
The packed path is only an accelerator: when any row is not clean (wrong dtype, unequal column
lengths, a mask or log-prob that a check would reject), the verifier takes the exact per-row
path so that errors are reported in Gym's order with Gym's text.
"""

from __future__ import annotations

import hashlib
import itertools
import struct

import numpy as np

from .constants import CALL_DIGEST_DOMAIN
from .encoding import U64_MAX

_BE_U64 = np.dtype(">u8")
_BE_F32 = np.dtype(">f4")
_U64 = np.dtype(np.uint64)
_F64 = np.dtype(np.float64)
_NDARRAY = np.ndarray


_LEN = struct.Struct(">Q")
_TWO_U64 = struct.Struct(">QQ")
_FOUR_U64 = struct.Struct(">QQQQ")
_HEAD = CALL_DIGEST_DOMAIN + bytes((2, 2, 1))   # domain, then the three versions (u8 each)
_MODES = {"text": _LEN.pack(4) + b"text", "token_in": _LEN.pack(8) + b"token_in"}


def _digest32(text) -> bytes | None:
    """The 32 bytes of a lowercase SHA-256 hex digest, or None for anything else (fromhex takes
    uppercase and spaces too: the round trip through hex() admits exactly 64 lowercase digits)."""
    if type(text) is not str or len(text) != 64:
        return None
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    return raw if raw.hex() == text else None


def _digests32(texts: list) -> list[bytes | None]:
    """``_digest32`` of each, decoded in one call when every one is plain (the common case)."""
    if all(type(t) is str and len(t) == 64 for t in texts):
        joined = "".join(texts)
        try:
            raw = bytes.fromhex(joined)
        except ValueError:
            raw = None
        if raw is not None and raw.hex() == joined:
            return [raw[k:k + 32] for k in range(0, len(raw), 32)]
    return [_digest32(t) for t in texts]


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _LEN.pack(len(raw)) + raw


class PackedRows:
    __slots__ = ("offsets", "bounds", "tokens", "masks", "logprobs", "token_be", "mask_f32", "lp_f32",
                 "carry", "order_ok", "token_rows")

    @classmethod
    def try_pack(cls, snapshots) -> "PackedRows | None":
        ids, masks, lps, lengths = [], [], [], []
        for s in snapshots:
            t, m, lp = s.token_ids_delta, s.token_mask_delta, s.generation_log_probs_delta
            if not (type(t) is _NDARRAY and type(m) is _NDARRAY and type(lp) is _NDARRAY):
                return None
            if t.dtype != _U64 or m.dtype != _F64 or lp.dtype != _F64:
                return None
            n = len(t)
            if n == 0 or len(m) != n or len(lp) != n or t.ndim != 1 or m.ndim != 1 or lp.ndim != 1:
                return None
            ids.append(t)
            masks.append(m)
            lps.append(lp)
            lengths.append(n)
        if not ids:
            return None
        self = cls()
        self.bounds = [0, *itertools.accumulate(lengths)]
        self.offsets = np.array(self.bounds, dtype=np.int64)
        self.tokens = np.concatenate(ids)
        self.masks = np.concatenate(masks)
        self.logprobs = np.concatenate(lps)
        generated = self.masks == 1.0
        carried = self.masks == 0.0
        if np.count_nonzero(generated) + np.count_nonzero(carried) != len(generated):
            return None  # a mask outside {0.0, 1.0}
        if np.logical_and(carried, self.logprobs != 0.0, out=carried).any():
            return None  # a carried position with a log-prob
        with np.errstate(over="ignore", invalid="ignore"):
            self.lp_f32 = self.logprobs.astype(_BE_F32)
        if not np.isfinite(self.lp_f32).all():
            return None  # NaN/inf, or a double that rounds to +-inf in float32
        self.mask_f32 = self.masks.astype(_BE_F32)
        self.token_be = self.tokens.astype(_BE_U64)
        tokens = memoryview(self.token_be)   # each row's n x u64be image, as a buffer (no copy)
        self.token_rows = [tokens[a:b] for a, b in zip(self.bounds, self.bounds[1:])]
        self._mask_shape(generated)
        return self

    def _mask_shape(self, generated: np.ndarray) -> None:
        """Per row: carry length (leading zeros) and whether the mask is carry-then-generation."""
        starts = self.offsets[:-1]
        ones = np.add.reduceat(generated, starts, dtype=np.int64)
        # a 1 -> 0 step inside a row breaks the order; one across a row boundary is fine
        drops = np.flatnonzero(np.diff(generated.view(np.int8)) < 0) + 1
        order_ok = np.ones(len(starts), dtype=bool)
        if drops.size:
            rows = np.searchsorted(self.offsets, drops, side="right") - 1
            order_ok[rows[drops != self.offsets[rows]]] = False
        self.order_ok = order_ok.tolist()
        # With a monotone mask the carry is the count of zeros; a non-monotone row never uses it.
        self.carry = [n - k for n, k in zip(np.diff(self.offsets).tolist(), ones.tolist())]

    def row(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def call_digests(self, snapshots) -> list[str | None]:
        """Each row's call digest (its snapshot's metadata over the packed columns), or None for
        a row whose fields are not plainly valid: the caller takes the exact path for it, which
        raises Gym's error in Gym's order (or computes the same digest).

        Plainly valid: exact versions, non-empty ``str`` ids, a known mode consistent with the
        parent and prev_len, ``int`` lengths in u64 range that join up with the packed column,
        and lowercase-hex digests: exactly the inputs for which the exact path cannot raise.
        Nothing here raises, so computing every row first keeps the errors in row order."""
        digests = _digests32([h for s in snapshots
                              for h in (s.extras_digest, s.chain_hash, s.cumulative_hash)])
        masks, lps = memoryview(self.mask_f32).cast("B"), memoryview(self.lp_f32).cast("B")
        bounds, token_rows, sha256, join = self.bounds, self.token_rows, hashlib.sha256, b"".join
        texts: dict[str, bytes] = {}
        out: list[str | None] = []
        for i, s in enumerate(snapshots):
            start, end = bounds[i], bounds[i + 1]
            n = end - start
            parent, mode = s.parent_call_id, s.mode
            prev, delta, cum, version = s.prev_len, s.delta_len, s.cum_len, s.weight_version
            rollout_id, call_id = s.rollout_id, s.model_call_id
            extras, chain, cumulative = digests[3 * i:3 * i + 3]
            if not (extras and chain and cumulative
                    and type(s.schema_version) is int and s.schema_version == 2
                    and type(s.digest_version) is int and s.digest_version == 2
                    and type(s.extras_digest_version) is int and s.extras_digest_version == 1
                    and type(rollout_id) is str and rollout_id and type(call_id) is str and call_id
                    and type(mode) is str and mode in _MODES
                    and type(prev) is int and type(delta) is int and type(cum) is int
                    and type(version) is int and 0 <= prev and 0 <= version <= U64_MAX
                    and delta == n and n > 0 and cum == prev + delta and cum <= U64_MAX
                    and (prev == 0 and mode == "text" if parent is None else
                         type(parent) is str and parent and prev != 0 and mode == "token_in")):
                out.append(None)
                continue
            try:
                rollout_text = texts.get(rollout_id)
                if rollout_text is None:
                    rollout_text = texts[rollout_id] = _text(rollout_id)
                parent_text = b"\x00" if parent is None else b"\x01" + _text(parent)
                call_text = _text(call_id)
            except UnicodeEncodeError:   # a lone surrogate: the exact path says so
                out.append(None)
                continue
            floats = _TWO_U64.pack(8 + 4 * n, n)
            out.append(sha256(join((
                _HEAD, rollout_text, call_text, parent_text, _MODES[mode],
                _FOUR_U64.pack(prev, delta, cum, version), _TWO_U64.pack(8 + 8 * n, n),
                token_rows[i], floats, masks[4 * start:4 * end], floats, lps[4 * start:4 * end],
                extras, b"\x01", chain, b"\x01", cumulative))).hexdigest())
        return out
