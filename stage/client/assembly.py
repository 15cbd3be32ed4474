"""Kafka-free half of the trainer-side reader: CanonicalRow (and RoutePlan) records -> complete
groups. ``GroupAssembler`` joins records by group id and de-duplicates by sample id;
``TrainingGroup`` is one complete group, padded to NeMo RL's training tensors on demand.

Duplicates are expected: an at-least-once stage, a replayed transaction, or a broker that shows
aborted records to read_committed readers (Tansu) can deliver a row twice. The first copy of a
sample id wins; a copy with different content is counted as a conflict (``counts``), never used.
A row the stage published in ``row_part`` records (larger than its max_record_bytes) counts once
all the parts of one copy of it are in (``stage.client.row_parts``: parts of two copies are never
mixed); ``merge_row_parts`` rebuilds the whole record (docs/schemas.md).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stage.finalize import CanonicalRow, FinalizedGroup, pad_group
from stage.client.row_parts import HELD, INVALID, STALE, RowCopies, WholeRow
from stage.client.row_parts import merge_row_parts  # noqa: F401  (its former home; fuzz invariants)
from stage.publish.records import MAX_ROW_PARTS
from stage.routes import RouteAssemblyPlan, RouteSpan, resolve_device
from stage.wire import unpack_torch

logger = logging.getLogger("stage.client.reader")
_ROW_TENSORS = ("input_ids", "generation_logprobs", "token_mask", "prompt_ids_for_adv")
_OPTIONAL_TENSORS = ("routed_experts", "generation_topk_ids", "generation_topk_logprobs")
# Media fields: allowed dtypes and dims (a row's logical row; see docs/schemas.md).
_MEDIA = {"pixel_values": (("float16", "bfloat16", "float32"), 2), "imgs_sizes": (("int32",), 2),
          "num_frames": (("int32",), 1)}


def row_from_record(record: Mapping[str, Any], *, device="cpu") -> CanonicalRow:
    """A decoded CanonicalRow value -> ``stage.finalize.CanonicalRow`` (torch on ``device``)."""
    target = resolve_device(device)
    tensors = {name: unpack_torch(record[name], device=target, field=name) for name in _ROW_TENSORS}
    optional = {name: None if record.get(name) is None
                else unpack_torch(record[name], device=target, field=name) for name in _OPTIONAL_TENSORS}
    media = {name: unpack_torch(record[name], device=target, field=name, expect_dtypes=dtypes,
                                expect_ndim=ndim)
             for name, (dtypes, ndim) in _MEDIA.items() if record.get(name) is not None} or None
    return CanonicalRow(
        group_id=record["group_id"], sample_id=record["sample_id"], row_index=record["row_index"],
        group_size=record["group_size"], prompt_idx=record["prompt_idx"],
        rollout_id=record["rollout_id"], weight_version=record["weight_version"],
        group_max_wv=record["group_max_wv"], valid=record["valid"],
        rejection_reason=record["rejection_reason"], input_lengths=record["input_lengths"],
        sample_mask=record["sample_mask"], total_reward=record["total_reward"],
        mask_sample=record["mask_sample"], truncated=record["truncated"], media=media,
        **tensors, **optional)


def route_plan_from_record(record: Mapping[str, Any]) -> RouteAssemblyPlan:
    """A decoded RoutePlan value -> the executor's RouteAssemblyPlan (coordinates dropped)."""
    return RouteAssemblyPlan(
        record["schema_version"], record["staging_partition"],
        tuple(RouteSpan(s["staging_key"], s["carry_len"], s["generation_len"], s["staged_route_len"],
                        s["extras_digest_version"], s["extras_digest"], s["boundary_token_index"],
                        s["repair_previous_token"]) for s in record["spans"]),
        tuple(record["cleanup_staging_keys"]), record["expected_token_length"])


@dataclass(eq=False)
class TrainingGroup:
    """One complete group: exactly ``group_size`` rows (row_index order), plans if deferred."""

    group_id: str
    rows: list[CanonicalRow]
    records: list[dict]                      # the decoded CanonicalRow values, same order
    plans: list[dict] | None = None          # the decoded RoutePlan values, same order
    first_seen: float = 0.0                  # time.monotonic() of its first record
    completed_at: float = 0.0                # time.monotonic() when its last record arrived
    # (topic, partition) -> (lowest, highest) offset of the group's records there
    offsets: dict = field(default_factory=dict)

    @property
    def group_min_wv(self) -> int:
        """The oldest weight version of the group (its rows' ``weight_version``)."""
        return self.rows[0].weight_version

    @property
    def group_max_wv(self) -> int:
        return self.rows[0].group_max_wv

    @property
    def group_size(self) -> int:
        return len(self.rows)

    @property
    def valid_rows(self) -> int:
        return sum(1 for row in self.rows if row.valid)

    @property
    def rejections(self) -> list[tuple[int, str]]:
        return [(row.row_index, row.rejection_reason) for row in self.rows if not row.valid]

    def finalized(self) -> FinalizedGroup:
        """The rows as the finalizer's FinalizedGroup (what ``pad_group`` takes)."""
        valid = [row for row in self.rows if row.valid]
        return FinalizedGroup(
            group_id=self.group_id, rows=self.rows, group_min_wv=self.rows[0].weight_version,
            group_max_wv=self.rows[0].group_max_wv, staging_keys=[], cleanup_staging_keys=[],
            canonical_output_tokens=int(sum(int(torch.count_nonzero(r.token_mask)) for r in valid)),
            metrics={}, valid_row_count=len(valid), total_row_count=len(self.rows))

    def tensors(self, *, pad_token_id: int = 0, device=None) -> dict[str, torch.Tensor]:
        """NeMo RL's training tensors (``stage.finalize.pad_group``): input_ids [N, max_len]
        padded with ``pad_token_id``, input_lengths, generation_logprobs, token_mask,
        sample_mask, prompt_ids_for_adv, total_reward, mask_sample, truncated, plus
        routed_experts (-1 padded) and top-k when the rows carry them, and in a group with
        media pixel_values, imgs_sizes, num_frames (the rows concatenated along dim 0, as
        NeMo RL's PackedTensor.as_tensor) with ``<field>__row_counts`` per row."""
        return pad_group(self.finalized(), pad_token_id=pad_token_id, device=device)


@dataclass(eq=False)
class _Pending:
    group_size: int
    first_seen: float
    rows: dict = field(default_factory=dict)     # row_index -> (record, digest)
    plans: dict = field(default_factory=dict)    # row_index -> (record, digest)
    copies: RowCopies = field(default_factory=RowCopies)   # split rows' copies until one is whole
    part_digests: dict = field(default_factory=dict)  # (row_index, part index) -> digest, whole rows
    offsets: dict = field(default_factory=dict)  # (topic, partition) -> [lowest, highest] offset

    def note(self, position: tuple[str, int, int] | None) -> None:
        if position is not None:
            topic, partition, offset = position
            span = self.offsets.setdefault((topic, partition), [offset, offset])
            span[0], span[1] = min(span[0], offset), max(span[1], offset)

    def spans(self) -> dict:
        return {tp: (low, high) for tp, (low, high) in self.offsets.items()}


def _digest(record: Mapping[str, Any], raw: bytes | None) -> bytes:
    if raw is None:
        raw = repr(sorted(record.items())).encode()
    return hashlib.blake2b(raw, digest_size=16).digest()


def _record_key(kind: str, record: Mapping[str, Any]) -> tuple:
    """What a record is a copy of: its row (or plan), or one part of a split row."""
    part = record.get("row_part") if kind == "rows" else None
    if part is None:
        return kind, record["row_index"]
    return kind, record["row_index"], part.get("index")


# ``GroupAssembler.completed`` values for groups that left assembly without being completed
# here: handed out before the position this reader started from, or abandoned incomplete.
BEFORE_START: dict = {}
ABANDONED: dict = {}


class GroupAssembler:
    """Joins row (and plan) records by group id; no Kafka. ``add_row`` / ``add_plan`` return
    the TrainingGroup they complete, else None.

    ``counts``: rows, plans, duplicates (same sample id, same content: dropped), conflicts
    (same sample id, other content: dropped, the first copy wins), invalid (a record that
    contradicts its group: wrong sample id, index out of range, another group size, row parts
    that do not make one copy of a row), stale_parts (row parts dropped: of a copy that began
    before this reader's start, or of an unfinished copy another copy replaced), groups, unusable (complete, but a row's tensors cannot be built:
    listed in ``unusable`` and left pending, so its records keep holding the offsets), replayed (a
    record of a group handed out before the reader's start position), abandoned (incomplete
    groups given up by ``abandon``) and late (records of an abandoned group).
    Completed groups are remembered (``remember`` most recent) so later copies of their rows
    are still recognised as duplicates or conflicts. ``last_group`` is the group id the last
    record belonged to and ``last_done`` whether that group had already left assembly, so a
    caller can account for the record's offset (``stage.client.position``).
    """

    def __init__(self, *, with_plans: bool = False, device="cpu", remember: int = 100_000) -> None:
        self.with_plans = with_plans
        self.device = device
        self.remember = remember
        self.pending: dict[str, _Pending] = {}
        self.completed: OrderedDict[str, dict] = OrderedDict()  # group -> {(kind, index): digest}
        self.counts: Counter = Counter()
        self.unusable: list[tuple[str, dict, str]] = []   # (group, offsets, error) not yet taken
        self.last_group: str | None = None
        self.last_done = False

    def add_row(self, record: Mapping[str, Any], raw: bytes | None = None,
                position: tuple[str, int, int] | None = None) -> TrainingGroup | None:
        """Rows are offered in partition order (row parts are joined per copy: the run of parts
        one publication wrote in a partition); ``position`` (topic, partition, offset) names the
        partition, None: all records come from one."""
        return self._add("rows", record, raw, position)

    def add_plan(self, record: Mapping[str, Any], raw: bytes | None = None,
                 position: tuple[str, int, int] | None = None) -> TrainingGroup | None:
        if not self.with_plans:
            raise ValueError("this assembler was built without with_plans=True")
        return self._add("plans", record, raw, position)

    def mark_done(self, group_ids, marker: dict = BEFORE_START) -> None:
        """Groups whose records must never start a group again (handed out before the start)."""
        for group_id in group_ids:
            self.completed[group_id] = marker

    def _add(self, kind: str, record, raw, position) -> TrainingGroup | None:
        self.counts[kind] += 1
        group_id, index = record["group_id"], record["row_index"]
        self.last_group, self.last_done = group_id, group_id in self.completed
        if self.last_done:
            done = self.completed[group_id]
            if done is BEFORE_START:
                self.counts["replayed"] += 1
            elif done is ABANDONED:
                self.counts["late"] += 1
            else:
                seen = done.get(_record_key(kind, record))
                self.counts["duplicates" if seen == _digest(record, raw) else "conflicts"] += 1
            return None
        pending = self.pending.get(group_id)
        if pending is not None:
            pending.note(position)       # every record of the group, kept or not, is its own
        if record["sample_id"] != f"{group_id}_g{index}":
            self.counts["invalid"] += 1
            return None
        size = record.get("group_size") if kind == "rows" else None
        if pending is None:
            if size is None:  # a plan before any row: size unknown yet, keep it aside
                pending = _Pending(group_size=0, first_seen=time.monotonic())
            elif not 0 <= index < size:
                self.counts["invalid"] += 1
                return None
            else:
                pending = _Pending(group_size=size, first_seen=time.monotonic())
            self.pending[group_id] = pending
            pending.note(position)
        elif size is not None:
            if pending.group_size == 0:
                pending.group_size = size
            elif size != pending.group_size:
                self.counts["invalid"] += 1
                return None
        if pending.group_size and not 0 <= index < pending.group_size:
            self.counts["invalid"] += 1
            return None
        held = getattr(pending, kind)
        digest = _digest(record, raw)
        if kind == "rows" and record.get("row_part") is not None:
            whole = self._add_part(pending, index, record, digest, position)
            if whole is None:
                return None
            record, digest = whole
        if index in held:
            self.counts["duplicates" if held[index][1] == digest else "conflicts"] += 1
            return None
        held[index] = (record, digest)
        return self._complete(group_id, pending)

    def _add_part(self, pending: _Pending, index: int, record, digest: bytes, position):
        """Hold one ``row_part`` record; the whole row's (record, digest) once the last part of
        its copy is in, else None."""
        part = record["row_part"]
        number, count = part["index"], part["count"]
        if not (2 <= count <= MAX_ROW_PARTS and 0 <= number < count):
            self.counts["invalid"] += 1
            return None
        if index in pending.rows:      # the row is whole: a part of a later copy
            seen = pending.part_digests.get((index, number))
            self.counts["duplicates" if seen == digest else "conflicts"] += 1
            return None
        copies = pending.copies
        dropped = copies.dropped
        outcome = copies.add(index, None if position is None else position[:2], record, digest)
        if isinstance(outcome, WholeRow):
            copies.drop_row(index)
        self.counts["stale_parts"] += copies.dropped - dropped
        if outcome is HELD or outcome is STALE:
            return None
        if outcome is INVALID:
            self.counts["invalid"] += 1
            logger.error("row %d: its %d parts do not make one row: %s", index, count, copies.last_error)
            return None
        pending.part_digests.update({(index, i): d for i, d in enumerate(outcome.part_digests)})
        return outcome.record, outcome.digest

    def _complete(self, group_id: str, pending: _Pending) -> TrainingGroup | None:
        n = pending.group_size
        if not n or len(pending.rows) != n or (self.with_plans and len(pending.plans) != n):
            return None
        if self.with_plans and any(not 0 <= i < n for i in pending.plans):
            return None  # a plan for a row index this group does not have: wait (invalid)
        records = [pending.rows[i][0] for i in range(n)]
        try:
            rows = [row_from_record(r, device=self.device) for r in records]
        except (ValueError, KeyError, TypeError) as error:   # e.g. a tensor of the wrong shape
            # stays pending (its records hold the position): the caller must not move past it
            self.counts["unusable"] += 1
            self.unusable.append((group_id, pending.spans(), f"{type(error).__name__}: {error}"))
            return None
        del self.pending[group_id]
        self.completed[group_id] = {**{("rows", i): d for i, (_, d) in pending.rows.items()},
                                    **{("plans", i): d for i, (_, d) in pending.plans.items()},
                                    **{("rows", i, p): d for (i, p), d in pending.part_digests.items()}}
        while len(self.completed) > self.remember:
            self.completed.popitem(last=False)
        self.counts["groups"] += 1
        return TrainingGroup(
            group_id=group_id, rows=rows, records=records,
            plans=[pending.plans[i][0] for i in range(n)] if self.with_plans else None,
            first_seen=pending.first_seen, completed_at=time.monotonic(), offsets=pending.spans())

    def abandon(self, group_id: str) -> dict:
        """Give up an incomplete group (its remaining records will never come); returns its
        offsets. Later records of it are counted as ``late``, never assembled again."""
        pending = self.pending.pop(group_id)
        self.completed[group_id] = ABANDONED
        self.counts["abandoned"] += 1
        return pending.spans()

    def forget(self, tps) -> list[str]:
        """Drop incomplete groups with records in these partitions (revoked: re-read elsewhere)."""
        gone = set(tps)
        dropped = [g for g, p in self.pending.items() if gone & set(p.offsets)]
        for group_id in dropped:
            del self.pending[group_id]
        return dropped

    def lowest_pending_offsets(self) -> dict[tuple[str, int], int]:
        """Per (topic, partition): the lowest offset an incomplete group still holds."""
        out: dict[tuple[str, int], int] = {}
        for pending in self.pending.values():
            for key, (low, _) in pending.offsets.items():
                out[key] = min(low, out.get(key, low))
        return out
