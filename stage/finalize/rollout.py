"""``finalize_rollout``: one receipt -> one verified row or a rejection with its reason.

Every guard of NeMo RL's finalizer, in its order, with its exact reason strings (reasons.py).
Rollout-level problems never raise: they become a rejected FinalizedRollout that keeps the
reward and the staging keys known so far.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from stage.contract import (
    RebuildError,
    ReceiptVerificationError,
    RolloutReceipt,
    verify_and_linearize,
)
from stage.finalize import reasons as R
from stage.config.finalize import ReassemblyConfig
from stage.finalize.failures import halt_cause
from stage.contract.records import parse_json_text
from stage.finalize.media import StagedMedia, concat_media, pixels_finite, validate_media
from stage.finalize.receipt_facts import ReceiptFacts, facts_of_raw, facts_of_receipt
from stage.finalize.source import FetchedStagedCall, TokenSource
from stage.staging import fits_float32
from stage.routes import (
    ConfiguredRouteDims,
    RouteAssemblyPlan,
    RouteDimsCache,
    RoutePlanBuildError,
    build_route_plan,
    execute_direct_plan,
)

_INT64_MAX = np.iinfo(np.int64).max
logger = logging.getLogger(__name__)


@dataclass(eq=False)
class FinalizedRollout:
    rollout_id: str
    valid: bool
    reward: float
    rejection_reason: str | None = None
    token_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    token_mask: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))
    logprobs: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))
    prompt_len: int = 0
    staging_keys: list[str] = field(default_factory=list)
    min_wv: int | None = None
    max_wv: int | None = None
    link_spans: list = field(default_factory=list)
    routed_experts: torch.Tensor | None = None    # direct mode, [len, L, K] int16
    route_plan: RouteAssemblyPlan | None = None   # whenever router replay is on
    media: StagedMedia | None = None
    topk_ids: np.ndarray | None = None            # int32 [len, k], zeros on carried tokens
    topk_logprobs: np.ndarray | None = None       # float32 [len, k]
    facts: ReceiptFacts | None = None             # what group metrics read; None: no receipt
    timings_ms: dict = field(default_factory=dict)  # verify (fetch + verify), routes


def _reject(rollout_id: str, reward: float, reason: str, keys=(), **extra) -> FinalizedRollout:
    return FinalizedRollout(rollout_id=rollout_id, valid=False, reward=reward,
                            rejection_reason=R.bounded(reason), staging_keys=list(keys), **extra)


def _unique_in_order(items) -> list:
    return list(dict.fromkeys(items))


class RolloutFinalizer:
    """Finalizes single rollouts against a TokenSource; keeps the learned route dims
    (stage.routes.dims: bounded, and agreed by a majority of rollouts)."""

    def __init__(self, source: TokenSource, config: ReassemblyConfig | None = None,
                 dims_cache: RouteDimsCache | None = None) -> None:
        self.source = source
        self.config = config or ReassemblyConfig()
        dims = self.config.route_dims
        self.dims_cache = (ConfiguredRouteDims(dims) if dims is not None
                           else dims_cache if dims_cache is not None else RouteDimsCache())
        # True when the source builds every snapshot through validation (both in-tree sources
        # do); verify_and_linearize then skips recomputing the call digests.
        self.source_validates = bool(getattr(source, "validates_snapshots", False))

    def finalize_rollout(self, rollout_id: str, receipt, *, reward: float) -> FinalizedRollout:
        """One verified row or a rejection; never raises for anything in the rollout's input.
        An exception no guard names rejects this rollout alone (``finalize_error``); only the
        causes ``stage.finalize.failures`` lists (device, host memory) propagate."""
        try:
            return self._finalize_rollout(rollout_id, receipt, reward=reward)
        except Exception as error:  # noqa: BLE001 - classified right here
            if halt_cause(error) is not None:
                raise
            logger.error("finalize: rollout %s raised %s; rejected (%s)", rollout_id,
                         type(error).__name__, R.FINALIZE_ERROR, exc_info=True)
            return _reject(rollout_id, reward if fits_float32(reward) else 0.0,
                           R.reason(R.FINALIZE_ERROR, f"{type(error).__name__}: {error}"))

    def _finalize_rollout(self, rollout_id: str, receipt, *, reward: float) -> FinalizedRollout:
        cfg = self.config
        if not fits_float32(reward):   # the stage's decoder refuses these; library callers may not
            return _reject(rollout_id, 0.0, R.reason(R.NON_FINITE_VALUE, "total_reward"))
        if receipt is None:
            return _reject(rollout_id, reward, R.MISSING_RECEIPT)
        raw = None
        try:  # parsed once, whatever the form (dict, JSON text or bytes, RolloutReceipt)
            if isinstance(receipt, RolloutReceipt):
                parsed = receipt
            else:
                raw = parse_json_text(receipt, RolloutReceipt.__name__)
                parsed = RolloutReceipt.from_json(raw)
        except (TypeError, ValueError) as error:
            return _reject(rollout_id, reward, R.reason(R.INVALID_RECEIPT, error), facts=facts_of_raw(raw))
        keys = [record.staging_key for record in parsed.manifest]
        info = dict(facts=facts_of_receipt(parsed))
        if parsed.rollout_id != rollout_id:
            return _reject(rollout_id, reward, R.reason(R.IDENTITY_MISMATCH, parsed.rollout_id), keys, **info)
        if parsed.failure_reason is not None:
            return _reject(rollout_id, reward, R.reason(R.ROLLOUT_FAILED, parsed.failure_reason), keys, **info)
        if parsed.capture_poisoned:
            return _reject(rollout_id, reward, R.CAPTURE_POISONED, keys, **info)
        if len(set(keys)) != len(keys):
            return _reject(rollout_id, reward, R.DUPLICATE_STAGING_KEY, _unique_in_order(keys), **info)
        call_ids = [record.model_call_id for record in parsed.manifest]
        if len(set(call_ids)) != len(call_ids):
            return _reject(rollout_id, reward, R.DUPLICATE_MANIFEST_CALL_ID, keys, **info)
        started = time.perf_counter()
        try:
            fetched = self.source.fetch_for_finalization(
                keys, include_route_fragments=cfg.direct_routes, include_topk=cfg.top_logprobs > 0)
        except KeyError as error:
            return _reject(rollout_id, reward, R.reason(R.MISSING_STAGING_ROW, error), keys, **info)
        except (TypeError, ValueError) as error:
            return _reject(rollout_id, reward, R.reason(R.INVALID_STAGING_ROW, error), keys, **info)
        for record, item in zip(parsed.manifest, fetched):
            if item.staging_key != record.staging_key:
                return _reject(rollout_id, reward, R.reason(R.STAGING_KEY_MISMATCH, record.model_call_id), keys, **info)
            if item.snapshot.model_call_id != record.model_call_id:
                return _reject(rollout_id, reward, R.reason(R.CALL_ID_MISMATCH, record.model_call_id), keys, **info)
        fetched_ids = [item.snapshot.model_call_id for item in fetched]
        if len(set(fetched_ids)) != len(fetched_ids):
            return _reject(rollout_id, reward, R.DUPLICATE_FETCHED_CALL_ID, keys, **info)
        try:
            # Sources validate each snapshot as they build it (digest included): no second pass.
            # A source that packed the rows' columns hands them over (verify checks that they
            # are these snapshots' own).
            packer = getattr(self.source, "packed_rows", None)
            row = verify_and_linearize(parsed, [item.snapshot for item in fetched],
                                       digests_verified=self.source_validates,
                                       packed=packer(keys) if packer is not None else None)
        except (KeyError, ValueError, TypeError, ReceiptVerificationError, RebuildError,
                NotImplementedError) as error:
            return _reject(rollout_id, reward, R.reason(R.REBUILD_FAILED, error), keys, **info)
        if row.token_ids.size and int(row.token_ids.max()) > _INT64_MAX:
            return _reject(rollout_id, reward, R.reason(R.INVALID_STAGING_ROW, R.TOKEN_ID_RANGE), keys, **info)
        verified = time.perf_counter()
        versions = [record.weight_version for record in parsed.manifest]
        out = FinalizedRollout(
            rollout_id=rollout_id, valid=True, reward=reward,
            token_ids=row.token_ids.astype(np.int64), token_mask=row.token_mask,
            logprobs=row.logprobs, prompt_len=row.prompt_len, staging_keys=keys,
            min_wv=min(versions), max_wv=max(versions), link_spans=list(row.link_spans), **info)
        by_call = {item.snapshot.model_call_id: item for item in fetched}
        rejection = (self._attach_media(out, by_call) if cfg.capture_media else None) \
            or (self._attach_topk(out, by_call, row) if cfg.top_logprobs > 0 else None)
        routes_ms = 0.0
        if rejection is None and cfg.router_replay:
            routes_started = time.perf_counter()
            rejection = self._attach_routes(out, parsed, fetched, row)
            routes_ms = (time.perf_counter() - routes_started) * 1e3
        out.timings_ms = {"verify": (verified - started) * 1e3, "routes": routes_ms}
        if rejection is not None:
            return _reject(rollout_id, reward, rejection, keys, **info)
        return out

    # -- media (guard 13) ------------------------------------------------------------------
    def _attach_media(self, out: FinalizedRollout, by_call: dict) -> str | None:
        with_media: list[FetchedStagedCall] = []
        for call_id, _carry, _gen in out.link_spans:
            item = by_call.get(call_id)
            if item is None:
                return R.reason(R.MEDIA_CHAIN_IDENTITY, call_id)
            if item.media_present:
                with_media.append(item)
        if not with_media:
            return None
        if len({item.media_has_frames for item in with_media}) > 1:
            return R.reason(R.MEDIA_CHAIN_INCOMPATIBLE, R.MEDIA_MIXED_KINDS)
        try:  # a rejected rollout never moves pixels: media is read only after verification
            parts = self.source.fetch_media([item.staging_key for item in with_media])
            for part in parts:
                validate_media(part, self.config.media_patch_size)
        except (KeyError, TypeError, ValueError) as error:
            return R.reason(R.INVALID_MEDIA_COLUMNS, error)
        if not all(pixels_finite(part) for part in parts):
            return R.reason(R.NON_FINITE_VALUE, "pixel_values")
        try:
            out.media = concat_media(parts)
        except (TypeError, ValueError) as error:
            return R.reason(R.MEDIA_CHAIN_INCOMPATIBLE, error)
        return None

    # -- sampler top-k (guard 14) ----------------------------------------------------------
    def _attach_topk(self, out: FinalizedRollout, by_call: dict, row) -> str | None:
        k = self.config.top_logprobs
        ids = np.zeros((len(out.token_ids), k), dtype=np.int32)
        lps = np.zeros((len(out.token_ids), k), dtype=np.float32)
        for (call_id, carry, gen), span in zip(out.link_spans, row.weight_version_spans):
            topk = by_call[call_id].topk
            if (topk is None or tuple(topk.ids.shape) != (gen, k)
                    or tuple(topk.logprobs.shape) != (gen, k)):
                return R.reason(R.TOPK_LENGTH_MISMATCH, call_id)
            if not np.isfinite(topk.logprobs).all():   # no digest binds these: check them here
                return R.reason(R.NON_FINITE_VALUE, "generation_topk_logprobs")
            ids[span.start + carry:span.end] = topk.ids
            lps[span.start + carry:span.end] = topk.logprobs
        out.topk_ids, out.topk_logprobs = ids, lps
        return None

    # -- routes (guards 15-22) -------------------------------------------------------------
    def _attach_routes(self, out: FinalizedRollout, parsed, fetched, row) -> str | None:
        cfg = self.config
        try:
            plan = build_route_plan(
                staging_partition=cfg.staging_partition, link_spans=row.link_spans,
                records_by_call={r.model_call_id: r for r in parsed.manifest},
                routed_len_by_call={i.snapshot.model_call_id: i.routed_len for i in fetched},
                extras_commitments=row.extras_commitments, cleanup_staging_keys=out.staging_keys,
                expected_token_length=len(out.token_ids),
                boundary_index_by_call={i.snapshot.model_call_id: i.boundary_token_index
                                        for i in fetched if i.boundary_token_index is not None},
                schema_version=cfg.route_plan_schema_version)
        except RoutePlanBuildError as error:
            return error.reason
        out.route_plan = plan
        if cfg.defer_routes:
            return None
        routes, failure = execute_direct_plan(
            plan, {i.staging_key: i.fragment for i in fetched}, self.dims_cache, device=cfg.device)
        if failure is not None:
            return R.reason(R.ROUTE_ASSEMBLY, failure)
        out.routed_experts = routes
        return None
