"""One finalization task: a taken group -> encoded output records (runs in a worker thread)."""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field

from stage.buffer import DEADLINE, GroupState
from stage.decode import InputLimits
from stage.finalize import GroupFinalizer, ReassemblyConfig
from stage.publish.records import (
    DROPPED,
    GroupContext,
    ledger_record,
    output_digest,
    plan_record,
    row_record,
    summary_record,
)
from stage.routes import RouteDimsCache
from stage.runtime.source import BufferTokenSource

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Outputs:
    """Encoded records of one group, ready for a transaction."""

    partition: int
    group_id: str
    epoch: int                       # assignment epoch of its partition when it was taken
    context: GroupContext
    records: list = field(default_factory=list)   # (topic, value bytes)
    ledger_value: bytes = b""
    outcome: str = ""
    valid_rows: int = 0
    total_rows: int = 0
    rejections: list = field(default_factory=list)
    finalize_s: float = 0.0
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    ready_at: float = 0.0


def context_of(group: GroupState, why: str, topics) -> GroupContext:
    return GroupContext(
        group_id=group.group_id, partition=group.partition, group_size=group.group_size,
        prompt_idx=group.fields.prompt_idx, outcome=why, first_timestamp_ms=group.first_timestamp_ms,
        last_timestamp_ms=group.last_timestamp_ms, max_offsets=dict(group.max_offsets),
        staged_positions={k: item.position for k, item in group.staged.items()})


def finalize_and_encode(group: GroupState, why: str, epoch: int, *, config: ReassemblyConfig,
                        dims_cache: RouteDimsCache, codecs, topics, limits: InputLimits,
                        now_ms) -> Outputs:
    """Never raises. A group that cannot be finalized or encoded (a device error, route dims
    the rows disagree on, a row over the record size cap) comes back with ``error`` set and no
    records: such a failure would repeat for every group, so the runtime halts the partition
    instead of publishing the group as dropped and committing past it."""
    ctx = context_of(group, why, topics)
    out = Outputs(group.partition, group.group_id, epoch, ctx)
    started = time.perf_counter()
    try:
        _finalize_into(out, group, why, config=config, dims_cache=dims_cache, codecs=codecs,
                       topics=topics, limits=limits, now_ms=now_ms)
    except Exception as error:  # noqa: BLE001 - reported to the runtime, which halts the partition
        logger.error("group %s could not be finalized: %s", group.group_id, traceback.format_exc())
        out.error = f"finalize_error: {type(error).__name__}: {error}"
        out.records, out.ledger_value = [], b""
    out.finalize_s = time.perf_counter() - started
    out.ready_at = time.monotonic()
    return out


def _finalize_into(out: Outputs, group: GroupState, why: str, *, config, dims_cache, codecs,
                   topics, limits, now_ms) -> None:
    ctx = out.context
    n = group.group_size
    receipts = [group.receipts.get(i) for i in range(n)]
    fields = group.fields   # group-level: the first receipt's (the buffer refused contradictions)
    rollout_ids = [r.rollout_id if r else f"{group.group_id}_g{i}" for i, r in enumerate(receipts)]
    source = BufferTokenSource(group.staged, partition_name=topics.staged_calls, limits=limits)
    finalizer = GroupFinalizer(source, config, dims_cache)
    result = finalizer.finalize_group(
        group.group_id, rollout_ids, [r.receipt if r else None for r in receipts],
        [r.reward if r else 0.0 for r in receipts],
        mask_sample=[r.mask_sample if r else False for r in receipts],
        fallback_weight_version=fields.fallback_weight_version, prompt_idx=fields.prompt_idx,
        loss_multiplier=fields.loss_multiplier, group_labels=fields.labels,
        result_stats=group.result_stats())
    encoded_rows = [codecs["CanonicalRow"].encode(row_record(row)) for row in result.rows]
    records = [(topics.canonical_rows, blob) for blob in encoded_rows]
    if config.router_replay and config.defer_routes:
        records += [(topics.route_plans, codecs["RoutePlan"].encode(plan_record(row, ctx.staged_positions)))
                    for row in result.rows]
    finalized_at = now_ms()
    records.append((topics.finalized_groups,
                    codecs["GroupSummary"].encode(summary_record(result, ctx, finalized_at))))
    out.outcome = DROPPED if result.dropped else why
    out.ledger_value = codecs["LedgerEntry"].encode(ledger_record(
        ctx, out.outcome, topics.receipts, topics.staged_calls, finalized_at, output_digest(encoded_rows)))
    out.records = records
    out.valid_rows, out.total_rows = result.valid_row_count, result.total_row_count
    out.rejections = [reason for _index, _rollout, reason in result.rejections]
    out.metrics = result.metrics


__all__ = ["DEADLINE", "Outputs", "context_of", "finalize_and_encode"]
