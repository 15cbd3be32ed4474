"""What must hold after any input, checked on a driven case (tests/fuzz/driver.py).

* Nothing raises past the stage's handlers (intake, finalize_and_encode).
* Every input record is accounted for by its offset: buffered (then published in its group's
  rows, or expired as an orphan staged call), dead-lettered with an error class and a reason,
  or skipped with a reason (duplicate, late, replayed).
* Every finalized group publishes exactly N rows, indices 0..N-1, a placeholder row carrying
  its reason, and a summary that agrees.
* Every float published is finite.
* Intake of one record traces at most ~20x its size (+ a constant) of memory.

Violations are tagged with the issue-18 item that fixes them when another branch owns the fix
(``GAPS``); an untagged violation is a bug in no one's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stage.client.assembly import merge_row_parts
from stage.publish.deadletters import ERROR_CLASSES
from stage.finalize.group import DROP_NO_ROUTE_DIMS
from stage.publish.records import DROPPED
from stage.wire import AvroCodec, WireError, unpack_tensor, unpack_torch
from tests.fuzz.driver import CaseResult, Driver
from tests.fuzz.traffic import RECEIPTS, STAGED

HALTS = "issue 18 item 1"        # input halts a partition (or drops a group without rows)
NONFINITE = "issue 18 item 2"    # a non-finite float published
CONFLICTS = "issue 18 item 4"    # a conflicting duplicate skipped as a plain duplicate
GAPS = {HALTS: "input must never halt a partition",
        NONFINITE: "nothing non-finite reaches the trainer",
        CONFLICTS: "a conflicting duplicate leaves a trace"}

MEMORY_RATIO = 20
MEMORY_FIXED = 256 * 1024
SKIP_REASONS = ("duplicate", "late", "replayed")
_CODECS = {name: AvroCodec(name, budget=False, max_record_bytes=1 << 30)
           for name in ("CanonicalRow", "GroupSummary", "RoutePlan", "ReceiptEvent", "StagedCall")}
_FLOAT_TENSORS = ("generation_logprobs", "token_mask", "generation_topk_logprobs", "pixel_values")


@dataclass(frozen=True)
class Violation:
    gap: str | None      # the issue-18 item that fixes it, or None
    text: str

    def __str__(self) -> str:
        return f"[{self.gap or 'untagged'}] {self.text}"


def check(result: CaseResult, driver: Driver) -> list[Violation]:
    out: list[Violation] = []
    out += [Violation(None, text) for text in result.raised]
    out += [Violation(HALTS, f"partition {p} halted: {why[:300]}") for p, why in result.halted.items()]
    out += [Violation(None, f"group {g} never finalized") for g in result.unfinished]
    out += _fates(result, driver.cfg.topics)
    for published in result.published:
        out += _group(published, driver.cfg)
    return out


def _identity(role: str, value: bytes) -> tuple:
    record = _CODECS["ReceiptEvent" if role == RECEIPTS else "StagedCall"].decode(value)
    if role == RECEIPTS:
        return (RECEIPTS, record["group_id"], record["rollout_index"])
    return (STAGED, record["group_id"], record["staging_key"])


def _fates(result: CaseResult, topics) -> list[Violation]:
    out = []
    first: dict[tuple, bytes] = {}   # identity -> the value of the record buffered under it
    published = {p.group_id: p for p in result.published}
    halted = set(result.halted)
    for fate in result.fates:
        where = f"{fate.topic}[{fate.partition}]@{fate.offset} ({fate.wire.note or 'unchanged'})"
        size = len(fate.wire.value or b"")
        if fate.peak_bytes > MEMORY_RATIO * size + MEMORY_FIXED:
            out.append(Violation(None, f"{where}: intake traced {fate.peak_bytes} bytes for a "
                                       f"{size}-byte record ({fate.peak_bytes / max(size, 1):.0f}x)"))
        if fate.outcome in ("raised", "unaccounted"):
            out.append(Violation(None, f"{where}: {fate.outcome}: {fate.reason}"))
        elif fate.outcome == "dead_letter":
            if fate.reason not in ERROR_CLASSES or not fate.text.strip():
                out.append(Violation(None, f"{where}: dead letter without class or reason: "
                                           f"{fate.reason!r} {fate.text!r}"))
        elif fate.outcome == "skipped":
            if fate.reason not in SKIP_REASONS:
                out.append(Violation(None, f"{where}: skipped for {fate.reason!r}"))
            elif fate.reason == "duplicate":
                identity = _identity(fate.wire.role, fate.wire.value)
                if first.get(identity) != fate.wire.value:
                    out.append(Violation(CONFLICTS, f"{where}: skipped as a duplicate of {identity}, "
                                                    "but its content differs"))
        elif fate.outcome == "added":
            identity = _identity(fate.wire.role, fate.wire.value)
            first.setdefault(identity, fate.wire.value)
            out += _added(fate, identity, published, halted, result, where, topics)
    return out


def _added(fate, identity, published, halted, result, where, topics) -> list[Violation]:
    group_id = identity[1]
    if fate.partition in halted:
        return []   # reported as the halt
    if fate.wire.role == STAGED:
        if group_id in published or (fate.topic, fate.partition, fate.offset) in result.orphaned:
            return []
        return [Violation(None, f"{where}: buffered staged call of {group_id} was neither published "
                                "nor expired")]
    group = published.get(group_id)
    if group is None:
        return [Violation(None, f"{where}: buffered receipt of {group_id} was never published")]
    if group.outputs.outcome == DROPPED:
        return []   # reported with the group
    rows = _rows(group, topics)
    if not any(r["row_index"] == identity[2] for r in rows):
        return [Violation(None, f"{where}: receipt of row {identity[2]} has no row in {group_id}")]
    return []


def _rows(published, topics) -> list[dict]:
    """The group's rows, a row published as ``row_part`` records joined as the reader joins it
    (every part present, in order)."""
    whole, parts = [], {}
    for row in _decoded(published, "CanonicalRow", topics):
        if row.get("row_part") is None:
            whole.append(row)
        else:
            parts.setdefault(row["row_index"], []).append(row)
    for index, pieces in sorted(parts.items()):
        pieces.sort(key=lambda r: r["row_part"]["index"])
        count = pieces[0]["row_part"]["count"]
        if [r["row_part"]["index"] for r in pieces] != list(range(count)):
            raise ValueError(f"row {index}: parts {[r['row_part'] for r in pieces]}")
        whole.append(merge_row_parts(pieces))
    return whole


def _decoded(published, schema: str, topics) -> list[dict]:
    topic = {"CanonicalRow": topics.canonical_rows, "GroupSummary": topics.finalized_groups,
             "RoutePlan": topics.route_plans}[schema]
    return [_CODECS[schema].decode(blob) for t, blob in published.outputs.records if t == topic]


def _group(published, cfg) -> list[Violation]:
    topics = cfg.topics
    out = []
    ctx = published.outputs.context
    n, group_id = ctx.group_size, published.group_id
    try:
        rows = _rows(published, topics)
        (summary,) = _decoded(published, "GroupSummary", topics)
    except (WireError, ValueError) as error:
        return [Violation(None, f"group {group_id}: its outputs do not decode: {error}")]
    if published.outputs.outcome == DROPPED:
        # NeMo RL's structural drop (its section 4.6): direct router replay, no valid row at all,
        # and (L, K) neither configured nor learned yet; the summary says so. Any other drop
        # loses a group the input could not have made unpublishable.
        dims_unknown = cfg.finalize.route_layers is None or cfg.finalize.route_topk is None
        if summary["drop_reason"] == DROP_NO_ROUTE_DIMS and dims_unknown and not summary["valid_rows"]:
            return []
        return [Violation(HALTS, f"group {group_id} dropped without rows: {summary['drop_reason']}")]
    indices = sorted(r["row_index"] for r in rows)
    if indices != list(range(n)):
        out.append(Violation(None, f"group {group_id}: rows {indices}, expected 0..{n - 1}"))
    if summary["total_rows"] != n or summary["valid_rows"] != sum(r["valid"] for r in rows):
        out.append(Violation(None, f"group {group_id}: summary says {summary['valid_rows']}/"
                                   f"{summary['total_rows']} rows"))
    for row in rows:
        where = f"group {group_id} row {row['row_index']}"
        if row["sample_id"] != f"{group_id}_g{row['row_index']}":
            out.append(Violation(None, f"{where}: sample_id {row['sample_id']!r}"))
        if row["valid"] == bool(row["rejection_reason"]):
            out.append(Violation(None, f"{where}: valid={row['valid']} with reason "
                                       f"{row['rejection_reason']!r}"))
        out += _finite(row, where)
    bad = [k for k, v in summary["metrics"].items() if not np.isfinite(v)]
    if bad:
        out.append(Violation(NONFINITE, f"group {group_id}: summary metrics {bad} not finite"))
    return out


def _finite(row: dict, where: str) -> list[Violation]:
    out = []
    for name in ("sample_mask", "total_reward"):
        if not np.isfinite(row[name]):
            out.append(Violation(NONFINITE, f"{where}: {name} = {row[name]} (valid={row['valid']})"))
    for name in _FLOAT_TENSORS:
        tensor = row.get(name)
        if tensor is None:
            continue
        values = (unpack_torch(tensor) if tensor["dtype"] == "bfloat16"
                  else torch.from_numpy(unpack_tensor(tensor).astype(np.float64)))
        if values.numel() and not bool(torch.isfinite(values.double()).all()):
            out.append(Violation(NONFINITE, f"{where}: {name} holds non-finite values "
                                            f"(valid={row['valid']})"))
    return out
