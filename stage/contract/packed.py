"""All rows' token columns packed into contiguous arrays, checked and hashed one rollout at a time.

The verifier must check and hash every row. Doing it per row costs a dozen numpy calls and a
few dozen Python operations each: on 500-token deltas that was several times the SHA-256 work,
more so on cores without AVX-512 (issue 31). So every check here is one pass over all rows:
numpy over the packed columns, C-level ``map``/``zip``/``set`` over the fields, and a list
comprehension where slicing is needed (a subscript in a comprehension is cheaper than ``map``
over ``__getitem__``); the per-row work left is hashlib's. The packed path is an accelerator:
when any row is not plainly valid (wrong types, unequal column lengths, a mask or log-prob a
check would reject) the caller takes the exact per-row path, which reports errors in Gym's
order with Gym's text.
"""

from __future__ import annotations

import hashlib
import struct
from collections import namedtuple
from itertools import accumulate, chain, repeat
from operator import add, attrgetter, eq, is_, methodcaller

import numpy as np

from .constants import CALL_DIGEST_DOMAIN, COMPARED_FIELDS, VERSION_FIELDS
from .encoding import U64_MAX

_BE_U64 = np.dtype(">u8")
_BE_F32 = np.dtype(">f4")
_U64 = np.dtype(np.uint64)
_F64 = np.dtype(np.float64)
_NDARRAY = np.ndarray

_LEN = struct.Struct(">Q")
_TWO_U64 = struct.Struct(">QQ")
_FOUR_U64 = struct.Struct(">QQQQ")
_SIX_U64 = struct.Struct(">QQQQQQ")
_HEAD = CALL_DIGEST_DOMAIN + bytes((2, 2, 1))   # domain, then the three versions (u8 each)
_MODES = {"text": _LEN.pack(4) + b"text", "token_in": _LEN.pack(8) + b"token_in"}
_MODE_NAMES = frozenset(_MODES)
_HEX = methodcaller("hexdigest")
_SHA256 = hashlib.sha256
_JOIN = b"".join

_TOKENS, _MASKS = attrgetter("token_ids_delta"), attrgetter("token_mask_delta")
_LOGPROBS = attrgetter("generation_log_probs_delta")
_DTYPE, _NDIM = attrgetter("dtype"), attrgetter("ndim")
# A row's fields as the verifier reads them for binding and for the call digest, in one tuple;
# ``Columns`` holds them transposed (one tuple per field, over the rows).
ROW_FIELDS = (*COMPARED_FIELDS, *VERSION_FIELDS)
ROW = attrgetter(*ROW_FIELDS)
ROLLOUT_ID = attrgetter("rollout_id")
Columns = namedtuple("Columns", ROW_FIELDS)
_STR_OR_NONE = {str, type(None)}


def columns_of(rows: list) -> Columns:
    return Columns._make(zip(*rows))


def all_ints(*columns) -> bool:
    """Every value is an ``int`` (not a bool, float or int subclass): one C pass over all."""
    return set(map(type, chain(*columns))) == {int}


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


def _hex_decoded(joined: str) -> bytes | None:
    """The bytes of concatenated lowercase hex digests, or None (see ``_digest32``)."""
    try:
        raw = bytes.fromhex(joined)
    except ValueError:
        return None
    return raw if raw.hex() == joined else None


def digests32(texts: list) -> list[bytes | None]:
    """``_digest32`` of each, decoded in one call when every one is plain (the common case)."""
    if texts and set(map(type, texts)) == {str} and set(map(len, texts)) == {64}:
        raw = _hex_decoded("".join(texts))
        if raw is not None:
            return [raw[k:k + 32] for k in range(0, len(raw), 32)]
    return list(map(_digest32, texts))


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _LEN.pack(len(raw)) + raw


def _texts(values) -> list[bytes]:
    """``_text`` of each ``str`` (TypeError for anything else), in C loops."""
    raw = list(map(str.encode, values))
    return list(map(add, map(_LEN.pack, map(len, raw)), raw))


def _plain_arrays(arrays: list, dtype) -> bool:
    """Every one a 1-D numpy array of ``dtype`` (in that order: a non-array has no dtype)."""
    return (set(map(type, arrays)) == {_NDARRAY} and set(map(_DTYPE, arrays)) == {dtype}
            and set(map(_NDIM, arrays)) == {1})


def _packed_column(arrays: list, dtype) -> np.ndarray:
    """1-D ``dtype`` arrays joined into one writable array: joining their buffers is ~2x
    faster than np.concatenate over ~70 arrays."""
    try:
        return np.frombuffer(bytearray().join(arrays), dtype)
    except (BufferError, TypeError):   # a strided view is not one buffer: numpy copies it
        return np.concatenate(arrays)


class PackedRows:
    __slots__ = ("offsets", "bounds", "lengths", "tokens", "masks", "logprobs", "token_be",
                 "mask_f32", "lp_f32", "carry", "order_ok", "shape_ok", "token_rows")

    @classmethod
    def try_pack(cls, snapshots) -> "PackedRows | None":
        ids = list(map(_TOKENS, snapshots))
        masks = list(map(_MASKS, snapshots))
        lps = list(map(_LOGPROBS, snapshots))
        if not (ids and _plain_arrays(ids, _U64) and _plain_arrays(masks, _F64) and _plain_arrays(lps, _F64)):
            return None
        lengths = list(map(len, ids))
        if 0 in lengths or lengths != list(map(len, masks)) or lengths != list(map(len, lps)):
            return None
        self = cls()
        self.lengths = lengths
        self.bounds = [0, *accumulate(lengths)]
        self.offsets = np.array(self.bounds, dtype=np.int64)
        total = self.bounds[-1]
        self.tokens = _packed_column(ids, _U64)
        self.masks = _packed_column(masks, _F64)
        self.logprobs = _packed_column(lps, _F64)
        generated = self.masks == 1.0
        carried = self.masks == 0.0
        if np.count_nonzero(generated) + np.count_nonzero(carried) != total:
            return None  # a mask outside {0.0, 1.0}
        if np.logical_and(carried, self.logprobs != 0.0, out=carried).any():
            return None  # a carried position with a log-prob
        with np.errstate(over="ignore", invalid="ignore"):
            lp32 = self.logprobs.astype(np.float32)   # native order: the finite check runs in SIMD
        if not np.isfinite(lp32).all():
            return None  # NaN/inf, or a double that rounds to +-inf in float32
        self.lp_f32 = lp32.astype(_BE_F32)
        self.mask_f32 = self.masks.astype(_BE_F32)
        self.token_be = self.tokens.astype(_BE_U64)
        tokens = memoryview(self.token_be)   # each row's n x u64be image, as a buffer (no copy)
        self.token_rows = [tokens[a:b] for a, b in zip(self.bounds, self.bounds[1:])]
        self._mask_shape(generated)
        return self

    def _mask_shape(self, generated: np.ndarray) -> None:
        """Per row (numpy arrays): carry length (leading zeros), whether the mask is
        carry-then-generation, and both that and "has a generated token" (``shape_ok``)."""
        starts = self.offsets[:-1]
        count = np.int32 if len(generated) < 2**31 else np.int64   # int32 sums: ~40% faster
        ones = np.add.reduceat(generated, starts, dtype=count)
        # a 1 -> 0 step inside a row breaks the order; one across a row boundary is fine
        drops = np.flatnonzero(generated[:-1] > generated[1:]) + 1
        self.order_ok = np.ones(len(starts), dtype=bool)
        if drops.size:
            rows = np.searchsorted(self.offsets, drops, side="right") - 1
            self.order_ok[rows[drops != self.offsets[rows]]] = False
        self.shape_ok = self.order_ok & (ones > 0)
        # With a monotone mask the carry is the count of zeros; a non-monotone row never uses it.
        self.carry = (self.offsets[1:] - starts) - ones

    def row(self, i: int) -> slice:
        return slice(self.bounds[i], self.bounds[i + 1])

    def call_digests(self, snapshots, columns: Columns | None = None) -> list[str | None]:
        """Each row's call digest (its snapshot's metadata over the packed columns), or None for
        a row whose fields are not plainly valid: the caller takes the exact path for it, which
        raises Gym's error in Gym's order (or computes the same digest).

        Plainly valid: exact versions, non-empty ``str`` ids, a known mode consistent with the
        parent and prev_len, ``int`` lengths in u64 range that join up with the packed column,
        and lowercase-hex digests: exactly the inputs for which the exact path cannot raise.
        Nothing here raises, so computing every row first keeps the errors in row order.
        Checked for all rows at once (``columns``: ``columns_of`` the snapshots' ``ROW``s, when
        the caller has them); when any row fails, row by row to find which."""
        if columns is None:
            columns = columns_of(list(map(ROW, snapshots)))
        digests = self._call_digests_plain(columns, list(map(ROLLOUT_ID, snapshots)))
        return self._call_digests_by_row(snapshots) if digests is None else digests

    def _call_digests_plain(self, c: Columns, rollout_ids: list) -> list[str] | None:
        """Every row's digest in passes over all rows, or None when any row is not plainly valid."""
        if not (all_ints(c.schema_version, c.digest_version, c.extras_digest_version, c.prev_len,
                         c.delta_len, c.cum_len, c.weight_version)
                and set(c.schema_version) == {2} and set(c.digest_version) == {2}
                and set(c.extras_digest_version) == {1}
                and set(map(type, chain(c.model_call_id, c.mode, rollout_ids))) == {str}
                and set(map(type, c.parent_call_id)) <= _STR_OR_NONE
                and "" not in rollout_ids and "" not in c.model_call_id and "" not in c.parent_call_id
                and set(c.mode) <= _MODE_NAMES and list(c.delta_len) == self.lengths
                and min(c.prev_len) >= 0 and min(c.weight_version) >= 0
                and max(c.weight_version) <= U64_MAX and max(c.cum_len) <= U64_MAX
                and list(map(add, c.prev_len, c.delta_len)) == list(c.cum_len)
                # a root (no parent) is text mode at 0, a child token_in after 0
                and list(map(is_, c.parent_call_id, repeat(None)))
                == list(map(eq, c.mode, repeat("text"))) == list(map(eq, c.prev_len, repeat(0)))):
            return None
        digests = c.extras_digest + c.chain_hash + c.cumulative_hash
        if not (set(map(type, digests)) == {str} and set(map(len, digests)) == {64}):
            return None
        # each row's tail (extras digest, 0x01, chain hash, 0x01, cumulative hash), decoded at once
        tails = _hex_decoded("".join(map("01".join, zip(c.extras_digest, c.chain_hash, c.cumulative_hash))))
        if tails is None:
            return None
        rollouts = list(set(rollout_ids))
        try:   # a lone surrogate: the exact path says so
            call_texts = _texts(c.model_call_id)
            heads = dict(zip(rollouts, map(add, repeat(_HEAD), _texts(rollouts))))
        except UnicodeEncodeError:
            return None
        # What follows the call id: the parent (another row of the rollout, whose text is that
        # row's) and the mode its presence implies. A parent absent from the rows (the graph
        # check rejects it later) is encoded by the exact path.
        parent_of = dict(zip(c.model_call_id, map(add, repeat(b"\x01"), call_texts)))
        parent_of[None] = b"\x00"
        parent_texts = list(map(parent_of.get, c.parent_call_id))
        if None in parent_texts:
            return None
        n = self.offsets[1:] - self.offsets[:-1]
        floats = list(map(_TWO_U64.pack, (8 + 4 * n).tolist(), self.lengths))
        numbers = map(_SIX_U64.pack, c.prev_len, c.delta_len, c.cum_len, c.weight_version,
                      (8 + 8 * n).tolist(), self.lengths)
        masks, lps = memoryview(self.mask_f32).cast("B"), memoryview(self.lp_f32).cast("B")
        spans = list(zip(self.bounds, self.bounds[1:]))
        payloads = map(_JOIN, zip(
            map(heads.__getitem__, rollout_ids), call_texts, parent_texts,
            map(_MODES.__getitem__, c.mode), numbers, self.token_rows,
            floats, [masks[4 * a:4 * b] for a, b in spans], floats, [lps[4 * a:4 * b] for a, b in spans],
            [tails[k:k + 98] for k in range(0, len(tails), 98)]))
        return list(map(_HEX, map(_SHA256, payloads)))

    def _call_digests_by_row(self, snapshots) -> list[str | None]:
        """``call_digests`` one row at a time: each row's own checks, None where one fails."""
        digests = digests32([h for s in snapshots
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
            extras, chain_hash, cumulative = digests[3 * i:3 * i + 3]
            if not (extras and chain_hash and cumulative
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
                extras, b"\x01", chain_hash, b"\x01", cumulative))).hexdigest())
        return out
