"""One finalization task: a taken group -> encoded output records (runs in a worker thread).

Which failures halt a partition is decided in one place, ``stage.finalize.failures``; this
module turns every other failure into rejections (``finalize_and_encode``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import traceback

from stage.buffer import DEADLINE, GroupState
from stage.decode import InputLimits
from stage.finalize import GroupFinalizer, ReassemblyConfig
from stage.finalize import reasons as R
from stage.finalize.failures import UNPUBLISHABLE, HaltCause, halt_cause
from stage.publish.outputs import Outputs, encode_group, encode_rows
from stage.publish.records import GroupContext, RowTooLarge
from stage.routes import RouteDimsCache
from stage.wire import pack_tensor
from stage.runtime.task.source import BufferTokenSource, RouteChunks, chunk_loader, spilled_loader

logger = logging.getLogger(__name__)


def context_of(group: GroupState, why: str, topics) -> GroupContext:
    return GroupContext(
        group_id=group.group_id, partition=group.partition, group_size=group.group_size,
        prompt_idx=group.fields.prompt_idx, outcome=why, first_timestamp_ms=group.first_timestamp_ms,
        last_timestamp_ms=group.last_timestamp_ms, max_offsets=dict(group.max_offsets),
        staged_positions={k: item.position for k, item in group.staged.items()})


def stage_limits(limits: InputLimits, topics, codecs) -> InputLimits:
    """``limits`` with the route reference bounds of this stage: its route topic, and chunks
    no larger than its record cap (the StagedCall codec's, which follows max_record_bytes)."""
    codec = codecs.get("StagedCall") if codecs else None
    cap = getattr(codec, "max_record_bytes", None) or limits.max_route_chunk_bytes
    return dataclasses.replace(limits, route_topic=topics.staged_routes, max_route_chunk_bytes=cap)


def route_chunks_of(rows) -> dict:
    """staging_key -> the RoutePlanChunks value of each converted row staged by reference:
    what the trainer needs to fetch its chunks and verify them (the reference as staged, the
    route encoding and metadata the extras digest binds, the inline boundary route)."""
    return {key: {"reference": row.route_ref.to_value(), "route_encoding": row.route_encoding,
                  "extras_metadata_json": row.extras_metadata_json.decode("utf-8"),
                  "boundary": None if row.boundary_routes is None else pack_tensor(row.boundary_routes)}
            for key, row in rows.items() if row.route_ref is not None}


def finalize_and_encode(group: GroupState, why: str, epoch: int, *, config: ReassemblyConfig,
                        dims_cache: RouteDimsCache, codecs, topics, limits: InputLimits,
                        now_ms) -> Outputs:
    """Never raises. What the group's input can cause becomes rejections: a rollout's own
    problems inside the finalizer; here, records too large to publish (a row is split into
    parts first) and anything the group step raises (``group_finalize_error`` on every row:
    N placeholder rows are still published). Only the causes ``stage.finalize.failures`` lists
    (device, host memory, a group not even publishable as placeholders) come back with
    ``error`` set and no records: they would fail every group, so the runtime halts the
    partition instead of publishing placeholders and committing past them."""
    ctx = context_of(group, why, topics)
    limits = stage_limits(limits, topics, codecs)
    out = Outputs(group.partition, group.group_id, epoch, ctx)
    started = time.perf_counter()
    run = functools.partial(_finalize_into, out, group, why, config=config, dims_cache=dims_cache,
                            codecs=codecs, topics=topics, limits=limits, now_ms=now_ms)
    try:
        run(rejected={})
    except Exception as error:  # noqa: BLE001 - classified: halt, or every row rejected
        cause = halt_cause(error)
        if cause is not None:
            _halt(out, cause, error)
        else:
            logger.error("group %s: finalization raised; every row rejected (%s): %s", group.group_id,
                         R.GROUP_FINALIZE_ERROR, traceback.format_exc())
            reason = R.reason(R.GROUP_FINALIZE_ERROR, f"{type(error).__name__}: {error}")
            try:
                run(rejected={i: reason for i in range(group.group_size)})
            except Exception as again:  # noqa: BLE001 - not even placeholders: the stage's fault
                _halt(out, halt_cause(again) or UNPUBLISHABLE, again)
    out.finalize_s = time.perf_counter() - started
    out.ready_at = time.monotonic()
    return out


def _halt(out: Outputs, cause: HaltCause, error: Exception) -> None:
    logger.error("group %s could not be finalized (halt cause %s: %s): %s", out.group_id, cause.name,
                 cause.action, "".join(traceback.format_exception(error)))
    out.error = f"finalize_error: {cause.name}: {type(error).__name__}: {error}"
    out.records, out.ledger_value = [], b""


def _finalize_into(out: Outputs, group: GroupState, why: str, *, config, dims_cache, codecs,
                   topics, limits, now_ms, rejected: dict) -> None:
    ctx = out.context
    n = group.group_size
    receipts = [group.receipts.get(i) for i in range(n)]
    fields = group.fields   # group-level: the first receipt's (the buffer refused contradictions)
    rollout_ids = [r.rollout_id if r else f"{group.group_id}_g{i}" for i, r in enumerate(receipts)]
    routes = None
    if config.direct_routes:   # the route chunks are an input: by-reference rows join theirs
        routes = RouteChunks(group.chunks, group_id=group.group_id, topic=topics.staged_routes,
                             partition=group.partition, load=chunk_loader(codecs.get("RouteChunk")))
    source = BufferTokenSource(group.staged, partition_name=topics.staged_calls, limits=limits,
                               load=spilled_loader(codecs.get("StagedCall"), keep_routes=config.direct_routes,
                                                   limits=limits), routes=routes)
    finalizer = GroupFinalizer(source, config, dims_cache)

    def finalize(rejected):
        return finalizer.finalize_group(
            group.group_id, rollout_ids, [r.receipt if r else None for r in receipts],
            [r.reward if r else 0.0 for r in receipts],
            mask_sample=[r.mask_sample if r else False for r in receipts],
            fallback_weight_version=fields.fallback_weight_version, prompt_idx=fields.prompt_idx,
            loss_multiplier=fields.loss_multiplier, group_labels=fields.labels,
            result_stats=group.result_stats(), rejected=rejected)

    result = finalize(rejected)
    ctx.route_chunks.update(route_chunks_of(source.converted()))
    encoded = encode_rows(result, config, codecs, ctx)
    if encoded.unpublishable:   # once: as placeholders those rows' records are a few hundred bytes
        logger.warning("group %s: rows %s rejected, their records cannot be published: %s",
                       group.group_id, sorted(encoded.unpublishable), encoded.unpublishable)
        result = finalize({**rejected, **encoded.unpublishable})
        encoded = encode_rows(result, config, codecs, ctx)
        if encoded.unpublishable:
            raise RowTooLarge(f"placeholder records cannot be published: {encoded.unpublishable}")
    encode_group(out, result, encoded, why, codecs=codecs, topics=topics, finalized_at=now_ms())


__all__ = ["DEADLINE", "Outputs", "context_of", "finalize_and_encode"]
