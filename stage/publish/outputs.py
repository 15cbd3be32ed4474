"""One finalized group -> its encoded output records, ready for a transaction.

``encode_rows`` encodes each row (split into parts over the record cap, stage.publish.records)
and, in deferred router replay, its route plan, and names the rows whose records cannot be
encoded (the finalize task re-finalizes those as placeholders); ``encode_group`` fills an
``Outputs`` with every record of the group: rows, plans, the summary and the ledger entry.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from stage.finalize import reasons as R
from stage.publish.plan_writer import encode_plan
from stage.publish.records import (
    DROPPED,
    SUMMARY_COMPACTIONS,
    GroupContext,
    RowTooLarge,
    encode_row,
    ledger_record,
    output_digest,
    plan_record,
    summary_record,
)
from stage.wire import WireError

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


@dataclass
class EncodedRows:
    rows: list[list[bytes]]          # each row's record parts
    plans: list[bytes]               # deferred router replay: each valid row's plan
    unpublishable: dict[int, str]    # row index -> rejection reason: its records cannot be encoded


def encode_rows(result, config, codecs, ctx: GroupContext) -> EncodedRows:
    rows, plans, unpublishable = [], [], {}
    deferred = config.router_replay and config.defer_routes
    for row in result.rows:
        try:
            rows.append(encode_row(row, codecs["CanonicalRow"]))
        except (RowTooLarge, WireError) as error:
            unpublishable[row.row_index] = R.reason(R.UNPUBLISHABLE_RECORD, f"CanonicalRow: {error}")
            continue
        if deferred:
            try:
                plans.append(encode_plan(codecs["RoutePlan"], plan_record(row, ctx.staged_positions,
                                                                          ctx.route_chunks)))
            except WireError as error:
                unpublishable[row.row_index] = R.reason(R.UNPUBLISHABLE_RECORD, f"RoutePlan: {error}")
    return EncodedRows(rows, plans, unpublishable)


def encode_group(out: Outputs, result, encoded: EncodedRows, why: str, *, codecs, topics,
                 finalized_at: int) -> None:
    """Every record of the group into ``out``: rows, plans, the summary, the ledger entry."""
    ctx = out.context
    encoded_rows = [blob for parts in encoded.rows for blob in parts]
    records = [(topics.canonical_rows, blob) for blob in encoded_rows]
    records += [(topics.route_plans, blob) for blob in encoded.plans]
    records.append((topics.finalized_groups, encode_summary(codecs["GroupSummary"], result, ctx,
                                                            finalized_at)))
    out.outcome = DROPPED if result.dropped else why
    out.ledger_value = codecs["LedgerEntry"].encode(ledger_record(
        ctx, out.outcome, topics, finalized_at, output_digest(encoded_rows)))
    out.records = records
    out.valid_rows, out.total_rows = result.valid_row_count, result.total_row_count
    out.rejections = [reason for _index, _rollout, reason in result.rejections]
    out.metrics = result.metrics
    split = [len(parts) for parts in encoded.rows if len(parts) > 1]
    if split:
        logger.info("group %s: %d rows over max_record_bytes published as %s parts", ctx.group_id,
                    len(split), split)


def encode_summary(codec, result, ctx: GroupContext, finalized_at: int) -> bytes:
    """The GroupSummary, compacted as far as needed to fit the codec's cap."""
    bad = sorted(k for k, v in result.metrics.items() if not math.isfinite(v))
    if bad:   # left out of the summary (summary_record counts them): a bug, say so
        logger.error("group %s: non-finite metrics left out of the summary: %s", ctx.group_id, bad)
    for compact in range(SUMMARY_COMPACTIONS):
        try:
            return codec.encode(summary_record(result, ctx, finalized_at, compact=compact))
        except WireError as error:
            if compact == SUMMARY_COMPACTIONS - 1:
                raise
            logger.warning("group %s: summary not encodable (%s); compacting it", ctx.group_id, error)
    raise AssertionError("unreachable")
