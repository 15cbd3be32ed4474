"""``verify_and_linearize``: Gym's receipt verifier (section 4), phases and check order exact.

Hot path: every row's call digest is recomputed from packed columns; the big-endian token image
of each row is computed once and reused for its call digest, chain hash and the cumulative hash
(over the chain's runs of rows, without a copy). The per-row loops call no Python function on
a row that passes (issue 31: a call per row per phase was a measurable share of the time on
slower cores); ``_compare_fields``, ``_recompute_digest`` and the list-column path run only
where a row needs them.
"""

from __future__ import annotations

import hashlib
import struct
from itertools import accumulate, repeat
from operator import attrgetter, sub

import numpy as np

from . import encoding as enc
from .constants import (
    CHAIN_HASH_DOMAIN,
    COMPARED_FIELDS,
    EXTRAS_DIGEST_VERSION,
    PREFIX_HASH_DOMAIN,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    VERSION_FIELDS,
    Code,
)
from .digests import check_staging_preconditions, staging_digest_from_image
from .errors import RebuildError, ReceiptVerificationError
from .linearized import ExtrasCommitment, LinearizedRow, WeightVersionSpan, build_all
from .native import native as _native
from .packed import PackedRows
from .records import RolloutReceipt, StagedCallBaseSnapshot

E = ReceiptVerificationError
R = RebuildError
_U64 = struct.Struct(">Q").pack


def verify_and_linearize(receipt, snapshots, *, digests_verified: bool = False,
                         packed: PackedRows | None = None) -> LinearizedRow:
    """Verify ``receipt`` against ``snapshots`` (one per manifest row, in manifest order) and
    return the linearized terminal chain. Raises ReceiptVerificationError / RebuildError.

    ``digests_verified`` (not in Gym's API): the caller built every snapshot through validation
    (which recomputes the call digest) and has not mutated it since, so the per-row digest
    recomputation is skipped. Every other check still runs. The finalizer's staged-row source
    qualifies; anything holding snapshots it did not validate itself does not.

    ``packed`` (not in Gym's API): these snapshots' columns as the caller already packed them
    (``PackedRows.select`` of its group's pack), under the same promise; used only when its rows
    are these very snapshot objects, in order, else the rows are packed here."""
    _gate(receipt)
    manifest = receipt.manifest
    snapshots = list(snapshots)
    images, packed = _bind_rows(receipt, manifest, snapshots, digests_verified, packed)
    by_id = {record.model_call_id: i for i, record in enumerate(manifest)}
    _check_graph(manifest, by_id)
    return _linearize(receipt, manifest, snapshots, by_id, images, packed)


def _gate(receipt) -> None:
    if not isinstance(receipt, RolloutReceipt):
        raise TypeError("receipt must be a RolloutReceipt")
    if receipt.schema_version != STAGING_SCHEMA_VERSION:
        raise E(Code.UNSUPPORTED_SCHEMA, f"receipt schema {receipt.schema_version}")
    if receipt.digest_version != STAGING_DIGEST_VERSION:
        raise E(Code.UNSUPPORTED_DIGEST, f"receipt digest {receipt.digest_version}")
    if receipt.extras_digest_version != EXTRAS_DIGEST_VERSION:
        raise E(Code.UNSUPPORTED_EXTRAS_DIGEST, f"receipt extras digest {receipt.extras_digest_version}")
    if receipt.failure_reason is not None:
        raise E(Code.ROLLOUT_FAILED, receipt.failure_reason)
    if receipt.capture_poisoned:
        raise E(Code.CAPTURE_POISONED, "receipt marks token capture as poisoned")
    if not receipt.manifest:
        raise E(Code.EMPTY_MANIFEST, "successful receipt has no committed calls")


def _bind_rows(receipt, manifest, snapshots, digests_verified: bool = False, given=None):
    """Phase B: unique ids and keys, one snapshot per row in order, fields equal, digests
    recomputed. Returns each row's big-endian token image and the packed columns (or None)."""
    ids: set[str] = set()
    keys: set[str] = set()
    for record in manifest:
        if record.model_call_id in ids:
            raise E(Code.DUPLICATE_MANIFEST_ROW, "model_call_id values are not unique")
        ids.add(record.model_call_id)
        if record.staging_key in keys:
            raise E(Code.DUPLICATE_STAGING_KEY, "staging keys are not unique")
        keys.add(record.staging_key)
    if len(snapshots) != len(manifest):
        raise E(Code.ROW_COUNT_MISMATCH, f"{len(snapshots)} snapshots for {len(manifest)} manifest rows")
    packed = None  # a non-snapshot is reported in row order below
    if given is not None and given.packs(snapshots):
        packed = given
    elif all(map(isinstance, snapshots, repeat(StagedCallBaseSnapshot))):
        packed = PackedRows.try_pack(snapshots)
    seen: set[str] = set()
    images = []
    # every row's digest at once (nothing raises there: errors stay in row order below)
    digests = packed.call_digests(snapshots) if packed is not None and not digests_verified else None
    for i, (record, snapshot) in enumerate(zip(manifest, snapshots)):
        if not isinstance(snapshot, StagedCallBaseSnapshot):
            raise TypeError("snapshots must contain StagedCallBaseSnapshot values")
        call_id = snapshot.model_call_id
        if call_id in seen:
            raise E(Code.DUPLICATE_SNAPSHOT, "model_call_id values are not unique")
        seen.add(call_id)
        if call_id not in ids:
            raise E(Code.SNAPSHOT_IDENTITY_MISMATCH, f"snapshot {call_id} is not in the manifest")
        if call_id != record.model_call_id:
            raise E(Code.SNAPSHOT_ORDER_MISMATCH, f"key {record.staging_key} expected "
                    f"{record.model_call_id}, received {call_id}")
        if snapshot.rollout_id != receipt.rollout_id:
            raise E(Code.WRONG_ROLLOUT, f"snapshot {record.model_call_id} belongs to {snapshot.rollout_id}")
        if not (_COMPARED(snapshot) == _COMPARED(record)   # _compare_fields' common case, inline
                and snapshot.schema_version == record.schema_version == receipt.schema_version
                and snapshot.digest_version == record.digest_version == receipt.digest_version
                and snapshot.extras_digest_version == record.extras_digest_version
                == receipt.extras_digest_version):
            _compare_fields(receipt, record, snapshot)   # raises, naming the field
        if packed is not None:
            image = packed.token_rows[i]
            if not digests_verified:
                digest = digests[i]   # None: not plainly valid, exact path
                if digest is None:
                    image = _recompute_digest(record, snapshot, packed, i)
                elif digest != snapshot.digest:
                    raise E(Code.CORRUPT_DIGEST, f"call {call_id}: staged digest mismatch")
            images.append(image)
        else:
            images.append(_recompute_digest(record, snapshot, packed, i))
    return images, packed


_COMPARED = attrgetter(*COMPARED_FIELDS)


def _compare_fields(receipt, record, snapshot) -> None:
    if _COMPARED(snapshot) == _COMPARED(record) and (
            snapshot.schema_version == record.schema_version == receipt.schema_version
            and snapshot.digest_version == record.digest_version == receipt.digest_version
            and snapshot.extras_digest_version == record.extras_digest_version
            == receipt.extras_digest_version):
        return  # the common case, checked in two C calls; the loop below names the field
    call_id = record.model_call_id
    for name in COMPARED_FIELDS:
        actual, expected = getattr(snapshot, name), getattr(record, name)
        if actual != expected:
            raise E(f"wrong_{name}", f"call {call_id}: snapshot {actual!r}, manifest {expected!r}")
    for name in VERSION_FIELDS:
        s, m, r = getattr(snapshot, name), getattr(record, name), getattr(receipt, name)
        if s != m or s != r:
            raise E(f"wrong_{name}", f"call {call_id}: snapshot={s}, manifest={m}, receipt={r}")


def _recompute_digest(record, s, packed, i):
    call_id = record.model_call_id
    if packed is not None:
        rows = packed.row(i)
        images = (lambda: packed.token_be[rows], lambda: packed.mask_f32[rows],
                  lambda: packed.lp_f32[rows])
    else:
        images = (lambda: enc.token_image(s.token_ids_delta),
                  lambda: enc.f32_image(s.token_mask_delta, "token_mask_delta"),
                  lambda: enc.f32_image(s.generation_log_probs_delta, "generation_log_probs_delta"))
    token_image = None

    def keep_token_image():
        nonlocal token_image
        token_image = images[0]()
        return token_image

    try:
        check_staging_preconditions(
            schema_version=s.schema_version, digest_version=s.digest_version,
            extras_digest_version=s.extras_digest_version, rollout_id=s.rollout_id,
            model_call_id=s.model_call_id, parent_call_id=s.parent_call_id, mode=s.mode,
            prev_len=s.prev_len, delta_len=s.delta_len, cum_len=s.cum_len,
            token_ids_delta=s.token_ids_delta, token_mask_delta=s.token_mask_delta,
            generation_log_probs_delta=s.generation_log_probs_delta, extras_digest=s.extras_digest,
            columns_checked=packed is not None)
        digest = staging_digest_from_image(
            rollout_id=s.rollout_id, model_call_id=s.model_call_id, parent_call_id=s.parent_call_id,
            mode=s.mode, prev_len=s.prev_len, delta_len=s.delta_len, cum_len=s.cum_len,
            weight_version=s.weight_version, token_image=keep_token_image,
            mask_image=images[1], logprob_image=images[2], extras_digest=s.extras_digest,
            chain_hash=s.chain_hash, cumulative_hash=s.cumulative_hash)
    except (TypeError, ValueError, OverflowError) as error:
        raise E(Code.INVALID_SNAPSHOT, f"call {call_id}: {error}") from None
    if digest != s.digest:
        raise E(Code.CORRUPT_DIGEST, f"call {call_id}: staged digest mismatch")
    return token_image


def _check_graph(manifest, by_id) -> None:
    """Phase C, step 9: parents exist, lengths join, no cycles (memoized ancestry walks).

    Producers list a call after its parent: when every parent's row comes before its child's,
    no cycle can exist, and the walks (a set and a list per row) are skipped; the first two
    checks run in the same order either way, so the first error is the same."""
    ordered = True
    for i, record in enumerate(manifest):
        parent = record.parent_call_id
        if parent is None:
            continue
        at = by_id.get(parent)
        if at is None or manifest[at].cum_len != record.prev_len:
            ordered = False   # the full pass below raises it, with its text
            break
        ordered = ordered and at < i
    if ordered:
        return
    acyclic: set[str] = set()
    for record in manifest:
        call_id, parent = record.model_call_id, record.parent_call_id
        if parent is not None:
            if parent not in by_id:
                raise R(Code.MISSING_PARENT, f"call {call_id} names absent parent {parent}")
            parent_cum = manifest[by_id[parent]].cum_len
            if parent_cum != record.prev_len:
                raise R(Code.PARENT_LENGTH_MISMATCH,
                        f"call {call_id} starts at {record.prev_len}, parent ends at {parent_cum}")
        walked: list[str] = []
        on_path: set[str] = set()
        node = call_id
        while node is not None and node in by_id and node not in acyclic:
            if node in on_path:
                raise R(Code.LINEAGE_CYCLE, f"cycle reaches call {node}")
            on_path.add(node)
            walked.append(node)
            node = manifest[by_id[node]].parent_call_id
        acyclic.update(walked)


def _linearize(receipt, manifest, snapshots, by_id, images, packed) -> LinearizedRow:
    terminal = receipt.terminal_model_call_id
    if terminal is None:
        raise R(Code.MISSING_TERMINAL, "successful receipt has no terminal call")
    if terminal not in by_id:
        raise R(Code.MISSING_TERMINAL, f"terminal call {terminal} is absent")
    chain = []
    node = terminal
    while node is not None:
        chain.append(by_id[node])
        node = manifest[by_id[node]].parent_call_id
    chain.reverse()

    records = [manifest[row] for row in chain]
    if packed is not None and _native is not None:   # the walk, the gather and the hash compiled
        carries, lengths = _native_chain_walk(records, chain, packed)
        ids, mask, lps, cumulative = _native.chain_gather(
            PREFIX_HASH_DOMAIN, chain, packed.starts, packed.ends, packed.tokens, packed.masks,
            packed.logprobs, packed.token_be)
        token_ids, token_mask = np.frombuffer(ids, np.uint64), np.frombuffer(mask, np.float64)
        logprobs = np.frombuffer(lps, np.float64)
    else:
        carries, lengths = _chain_walk(records, chain, snapshots, images, packed)
        token_ids, token_mask, logprobs, cumulative = _gather_and_hash(
            chain, snapshots, images, packed, sum(lengths))
    if not token_mask.any():
        raise R(Code.EMPTY_TRAINING_ROW, "terminal chain has no generated tokens")
    last = records[-1]
    if last.cumulative_hash != cumulative:
        raise R(Code.CUMULATIVE_HASH_MISMATCH, f"terminal call {last.model_call_id} cumulative hash "
                "does not cover the linearized tokens")
    call_ids = [record.model_call_id for record in records]
    versions = [record.weight_version for record in records]
    ends = list(accumulate(lengths))
    return LinearizedRow(
        rollout_id=receipt.rollout_id, token_ids=token_ids, token_mask=token_mask,
        logprobs=logprobs, model_call_ids=call_ids, prompt_len=carries[0], weight_versions=versions,
        weight_version_spans=build_all(WeightVersionSpan, call_ids, [0, *ends[:-1]], ends, versions),
        link_spans=list(zip(call_ids, carries, map(sub, lengths, carries))),
        extras_commitments=build_all(ExtrasCommitment, call_ids,
                                     [record.extras_digest_version for record in records],
                                     [record.extras_digest for record in records]))


def _gather_and_hash(chain, snapshots, images, packed, total: int):
    """The chain's token ids, masks and log-probs, root first, and the cumulative hash (hex)
    over its ``total`` tokens' images."""
    h = hashlib.sha256(PREFIX_HASH_DOMAIN)
    h.update(_U64(total))
    if packed is not None:
        parts = _chain_parts(chain, packed.starts, packed.ends)
        token_ids = _gather_parts(packed.tokens, parts)
        token_mask = _gather_parts(packed.masks, parts)
        logprobs = _gather_parts(packed.logprobs, parts)
        token_be = memoryview(packed.token_be)
        for part in parts:   # the chain's token images where they lie, no copy
            h.update(token_be[part])
    else:
        token_ids, token_mask, logprobs = _gather(chain, snapshots)
        for row in chain:
            h.update(images[row])
    return token_ids, token_mask, logprobs, h.hexdigest()


def _chain_walk(records, chain, snapshots, images, packed) -> tuple[list[int], list[int]]:
    """Each chain row's chain hash extends its parent's and matches its manifest row; its mask
    is carry-then-generation with a generation. Returns the chain's carries and lengths."""
    carries, lengths = [], []
    if packed is not None:   # the mask shapes were computed for all rows at once
        carry_of, order_of, length_of = packed.carry, packed.order_ok, packed.lengths
    running_raw = None
    sha256, join = hashlib.sha256, b"".join
    for record, row in zip(records, chain):
        marker = b"\x00" if running_raw is None else b"\x01" + running_raw
        image = images[row]
        running_raw = sha256(join((CHAIN_HASH_DOMAIN, marker, _U64(len(image)), image))).digest()
        if record.chain_hash != running_raw.hex():
            _raise_chain_failure(record, _CHAIN_HASH_MISMATCH)
        if packed is not None:
            carry, order_ok, n = carry_of[row], order_of[row], length_of[row]
        else:
            carry, order_ok, n = _mask_shape(snapshots[row])
        if not order_ok:
            _raise_chain_failure(record, _INVALID_MASK_ORDER)
        if carry == n:
            _raise_chain_failure(record, _EMPTY_GENERATION)
        carries.append(carry)
        lengths.append(n)
    return carries, lengths


def _native_chain_walk(records, chain, packed) -> tuple[list[int], list[int]]:
    """``_chain_walk`` on packed rows, the hashing and checks in one compiled call: it names
    the first failing chain row and why, in the Python walk's order; the error is raised here.
    The images are the packed token rows (``_recompute_digest`` returns the same bytes)."""
    failed = _native.chain_walk(CHAIN_HASH_DOMAIN, [record.chain_hash for record in records],
                                packed.token_be, chain, packed.starts, packed.ends,
                                packed.order_ok, packed.carry)
    if failed is not None:
        _raise_chain_failure(records[failed[0]], failed[1])
    carry_of, length_of = packed.carry, packed.lengths
    return [carry_of[row] for row in chain], [length_of[row] for row in chain]


# stage._native.chain_walk's failure codes
_CHAIN_HASH_MISMATCH, _INVALID_MASK_ORDER, _EMPTY_GENERATION = 0, 1, 2


def _raise_chain_failure(record, code: int):
    call_id = record.model_call_id
    if code == _CHAIN_HASH_MISMATCH:
        raise R(Code.CHAIN_HASH_MISMATCH, f"call {call_id} does not extend its parent's staged chain")
    if code == _INVALID_MASK_ORDER:
        raise R(Code.INVALID_MASK_ORDER, f"call {call_id} mask is not carry-then-generation")
    raise R(Code.EMPTY_GENERATION, f"call {call_id} contains no policy-generated token")


def _mask_shape(snapshot) -> tuple[int, bool, int]:
    """(carry length, mask is carry-then-generation, delta length) of one Python-list row."""
    mask = np.asarray(snapshot.token_mask_delta, dtype=np.float64)
    generated = mask != 0.0
    n = len(mask)
    carry = int(np.argmax(generated)) if generated.any() else n
    return carry, bool((mask[carry:] == 1.0).all()), n


def _chain_parts(chain: list, starts: list, ends: list) -> list[slice]:
    """The chain's rows as slices of the packed columns, adjacent rows merged (off-chain rows
    sit between runs)."""
    parts = []
    for r in chain:
        start, end = starts[r], ends[r]
        if parts and parts[-1].stop == start:
            parts[-1] = slice(parts[-1].start, end)
        else:
            parts.append(slice(start, end))
    return parts


def _gather_parts(column: np.ndarray, parts: list[slice]) -> np.ndarray:
    """The chain's values of one packed column: the column itself when the chain is every row
    in order, else its parts concatenated."""
    if len(parts) == 1 and parts[0].start == 0 and parts[0].stop == len(column):
        return column
    return np.concatenate([column[part] for part in parts])


def _gather(chain, snapshots):
    """The chain's token ids, masks and log-probs of Python-list rows, concatenated root first."""
    ids = np.concatenate([np.asarray(snapshots[r].token_ids_delta, dtype=np.uint64) for r in chain])
    masks = np.concatenate([np.asarray(snapshots[r].token_mask_delta, dtype=np.float64) for r in chain])
    lps = np.concatenate([np.asarray(snapshots[r].generation_log_probs_delta, dtype=np.float64)
                          for r in chain])
    return ids, masks, lps
