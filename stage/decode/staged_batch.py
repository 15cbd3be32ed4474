"""``staged_rows``: many StagedCall records -> StagedRows at once, for finalization.

``staged_row`` validates one record as Gym's model does (its fields, its model rules, its call
digest): ~50 us for a 512-token call, most of it per-call Python around a 5 us hash. A rollout
of 64 calls is fetched at once, so its snapshots are checked together: the fields for plain
validity (the wire schema fixes their types; the values are checked as the field parsers
would), the model rules on the packed columns, and every call digest in one pass
(``stage.contract.packed``). Only rows that pass everything come back; every other row comes
back as None and the caller converts it with ``staged_row``, which raises the exact error in
the exact order (or, when the batch was merely conservative, returns the same row).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stage.contract import StagedCallBaseSnapshot
from stage.contract.constants import CAPTURE_MODES
from stage.contract.encoding import U64_MAX, is_digest_hex
from stage.contract.packed import PackedRows
from stage.decode.limits import InputLimits
from stage.decode.staged import _SNAPSHOT_FIELDS, staged_columns, staged_row_of
from stage.staging import StagedRow


def _plain_fields(record: dict) -> dict | None:
    """The snapshot fields when each passes its field parser unchanged, else None."""
    fields = {name: record.get(name) for name in _SNAPSHOT_FIELDS}
    rollout_id, call_id, parent = fields["rollout_id"], fields["model_call_id"], fields["parent_call_id"]
    ok = (type(fields["schema_version"]) is int and fields["schema_version"] == 2
          and type(fields["digest_version"]) is int and fields["digest_version"] == 2
          and type(fields["extras_digest_version"]) is int and fields["extras_digest_version"] == 1
          and type(rollout_id) is str and rollout_id and type(call_id) is str and call_id
          and (parent is None or (type(parent) is str and parent))
          and type(fields["mode"]) is str and fields["mode"] in CAPTURE_MODES
          and all(type(fields[n]) is int and 0 <= fields[n] <= U64_MAX
                  for n in ("prev_len", "delta_len", "cum_len", "weight_version"))
          and all(is_digest_hex(fields[n]) for n in ("digest", "extras_digest", "chain_hash", "cumulative_hash")))
    return fields if ok else None


_IDS = {"uint32": np.dtype("<u4"), "uint64": np.dtype("<u8")}     # unsigned: none is negative
_FLOATS = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}
_COLUMNS = (("token_ids_delta", _IDS, np.uint64), ("token_mask_delta", _FLOATS, np.float64),
            ("generation_log_probs_delta", _FLOATS, np.float64))


def _plain_columns(record: dict, delta: int):
    """``staged_columns`` of a record whose three columns are plainly what it accepts (a
    PackedTensor dict of an unsigned id or float dtype, shape [delta_len], exactly its bytes):
    the same arrays without unpack_tensor's checks of everything else; None for anything else
    (``staged_columns`` then decides, raising its error)."""
    out = []
    for name, dtypes, target in _COLUMNS:
        tensor = record.get(name)
        if type(tensor) is not dict:
            return None
        dtype, shape, data = dtypes.get(tensor.get("dtype")), tensor.get("shape"), tensor.get("data")
        if (dtype is None or type(shape) is not list or len(shape) != 1 or type(shape[0]) is not int
                or shape[0] != delta or type(data) is not bytes or len(data) != delta * dtype.itemsize):
            return None
        out.append(np.frombuffer(data, dtype).astype(target))
    return out


def staged_rows(records: Sequence[dict], limits: InputLimits = InputLimits(), *,
                partitions: Sequence[int | None] | None = None,
                packing: dict | None = None) -> list[StagedRow | None]:
    """``staged_row`` of each record that is valid throughout; None for any other.
    ``partitions``: each record's own (what a route reference must name), None: unchecked.
    ``packing``: a dict that receives ``packed``, the columns the rows were checked on (or
    None), and ``rows``, each record's row index in them (None where no row came back): the
    verifier takes a rollout's rows from that pack (``PackedRows.select``) instead of packing
    them again."""
    out, packed, rows = _staged_rows(records, limits, partitions)
    if packing is not None:
        packing.update(packed=packed, rows=rows)
    return out


def _staged_rows(records, limits, partitions):
    snapshots: list[StagedCallBaseSnapshot | None] = []
    for record in records:
        fields = _plain_fields(record)
        snapshot = None
        if fields is not None:
            columns = _plain_columns(record, fields["delta_len"])
            try:
                ids, mask, logprobs = columns if columns is not None else staged_columns(record)
            except (ValueError, TypeError, KeyError):
                ids = None
            if ids is not None:
                snapshot = StagedCallBaseSnapshot.construct(
                    **fields, token_ids_delta=ids, token_mask_delta=mask, generation_log_probs_delta=logprobs)
        snapshots.append(snapshot)
    plain = [s for s in snapshots if s is not None]
    # The model rules, in bulk: masks in {0, 1}, carried log-probs 0, log-probs finite in float32
    # (try_pack refuses anything else: then every row takes the exact path).
    packed = PackedRows.try_pack(plain) if plain else None
    if packed is None:
        return [None] * len(records), None, [None] * len(records)
    digests = iter(packed.call_digests(plain))   # None where a rule or an encoding says no
    out: list[StagedRow | None] = []
    rows: list[int | None] = []
    row = -1
    for index, (record, snapshot) in enumerate(zip(records, snapshots)):
        if snapshot is None:
            out.append(None)
            rows.append(None)
            continue
        row += 1
        digest = next(digests)
        made = None
        if digest is not None and digest == snapshot.digest:
            try:
                made = staged_row_of(record, snapshot, limits,
                                     partition=None if partitions is None else partitions[index])
            except (ValueError, TypeError, KeyError):
                made = None
        out.append(made)
        rows.append(None if made is None else row)
    return out, packed, rows
