"""``finalize_group``: N receipts -> exactly N canonical rows (placeholders for rejections).

NeMo RL section 4. Rows stay jagged (each row's columns have its own length); ``pad_group``
builds the padded training tensors for readers that want them. Tensors are torch on the
configured device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from stage.contract import TERMINAL_SELECTIONS
from stage.finalize import reasons as R
from stage.finalize.labels import group_label_stats
from stage.finalize.group_media import group_media_rows, media_tensors, pad_group_media
from stage.finalize.receipt_facts import group_receipt_metrics
from stage.finalize.rollout import FinalizedRollout, RolloutFinalizer, _reject, fits_float32
from stage.routes import (
    ROUTE_FAILURE_MODEL_SHAPE,
    GroupDims,
    RouteAssemblyPlan,
    group_route_rows,
    pad_route_rows,
    placeholder_route_plan,
    resolve_device,
    validated_route_plan_size_bytes,
)

logger = logging.getLogger(__name__)
# One INFO line per rejected rollout, as NeMo RL prints it. Its own logger so an operator can
# silence it without losing the stage's other INFO lines (docs/configuration.md).
REJECTION_LOGGER = "stage.finalize.rejections"
rejection_log = logging.getLogger(REJECTION_LOGGER)

DROP_NO_ROUTE_DIMS = "router replay on, no rollout carried routed_experts, and (L, K) is unknown yet"


@dataclass(eq=False)
class CanonicalRow:
    """One published training row (jagged: every token column has ``input_lengths`` entries)."""

    group_id: str
    sample_id: str
    row_index: int
    group_size: int
    prompt_idx: int
    rollout_id: str
    weight_version: int          # the group's minimum
    group_max_wv: int
    valid: bool
    rejection_reason: str | None
    input_ids: torch.Tensor              # int64 [len]
    input_lengths: int
    generation_logprobs: torch.Tensor    # float32 [len]
    token_mask: torch.Tensor             # float32 [len]
    sample_mask: float
    prompt_ids_for_adv: torch.Tensor     # int64 [prompt]
    total_reward: float
    mask_sample: bool
    truncated: bool
    staging_keys: list[str] = field(default_factory=list)
    routed_experts: torch.Tensor | None = None         # int16 [len, L, K], direct mode
    generation_topk_ids: torch.Tensor | None = None    # int32 [len, k]
    generation_topk_logprobs: torch.Tensor | None = None  # float32 [len, k]
    # pixel_values [patches, 3*P*P], imgs_sizes int32 [N, 2], num_frames int32 [V]: the row's
    # chain media, or an empty logical row (zero entries) in a group where another row has
    # media; None in a text-only group (NeMo RL's _media_fields_for_group).
    media: dict | None = None
    route_plan: RouteAssemblyPlan | None = None         # deferred mode


@dataclass(eq=False)
class FinalizedGroup:
    group_id: str
    rows: list[CanonicalRow]
    group_min_wv: int
    group_max_wv: int
    staging_keys: list[str]          # deferred: every manifest key (kept for the policy); else []
    cleanup_staging_keys: list[str]  # every manifest key of the group, all modes
    canonical_output_tokens: int
    metrics: dict[str, float]
    valid_row_count: int
    total_row_count: int
    dropped: bool = False
    drop_reason: str | None = None
    # (row_index, rollout_id, reason) of every rejected rollout, kept even when the group drops
    rejections: list = field(default_factory=list)
    # direct mode: the rows carry their own routes; the padded group tensor is built from them
    # on first use (at agentic sizes it is mostly padding: one 128k-token row pads 15 others)
    route_dims: tuple[int, int] | None = None
    _routed_experts: torch.Tensor | None = field(default=None, repr=False)

    @property
    def routed_experts(self) -> torch.Tensor | None:
        """Direct mode group tensor ``[n, max_len, L, K]`` int16, -1 padded (None otherwise)."""
        if self._routed_experts is None and self.route_dims is not None and self.rows:
            max_len = max(row.input_lengths for row in self.rows)
            self._routed_experts = pad_route_rows(
                [row.routed_experts if row.valid else None for row in self.rows], max_len,
                self.route_dims, device=self.rows[0].input_ids.device)
        return self._routed_experts


def _demote(row: FinalizedRollout, reason: str) -> FinalizedRollout:
    """A verified rollout rejected for a group-level reason: its keys, facts and timings kept."""
    return _reject(row.rollout_id, row.reward, reason, row.staging_keys, facts=row.facts,
                   timings_ms=row.timings_ms)


class GroupFinalizer(RolloutFinalizer):
    """finalize_rollout for each member, then the group's rows, metrics and routes."""

    def finalize_group(self, group_id: str, rollout_ids, receipts, rewards, *, mask_sample,
                       fallback_weight_version: int, prompt_idx: int, loss_multiplier: float = 1.0,
                       canonical_sample_ids=None, group_labels=(), result_stats=(),
                       rejected: Mapping[int, str] | None = None) -> FinalizedGroup:
        """``rejected``: row index -> reason, rollouts the caller rejects without finalizing
        them (the stage's rows whose records could not be published; no staging keys)."""
        n = len(rollout_ids)
        if not (len(receipts) == n and len(rewards) == n and len(mask_sample) == n):
            raise ValueError("rollout_ids, receipts, rewards, and mask_sample must be parallel")
        if n == 0:
            raise ValueError("a group needs at least one rollout")
        cfg = self.config
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        rejected = rejected or {}
        rows = [_reject(rid, float(reward) if fits_float32(float(reward)) else 0.0, rejected[i])
                if i in rejected else self.finalize_rollout(rid, receipt, reward=float(reward))
                for i, (rid, receipt, reward) in enumerate(zip(rollout_ids, receipts, rewards))]
        if not fits_float32(loss_multiplier):   # every valid row would publish it as sample_mask
            rows = [_demote(row, R.reason(R.NON_FINITE_VALUE, "sample_mask")) if row.valid else row
                    for row in rows]
        settled = None
        if cfg.direct_routes:
            rows, settled = self._settle_route_dims(rows)
        metrics["row_assembly/rollouts_ms"] = (time.perf_counter() - t0) * 1e3
        for part in ("verify", "routes"):  # the per-rollout split of rollouts_ms
            metrics[f"row_assembly/{part}_ms"] = sum(r.timings_ms.get(part, 0.0) for r in rows)
        valid_rows = [row for row in rows if row.valid]
        rejections = [(i, r.rollout_id, r.rejection_reason) for i, r in enumerate(rows) if not r.valid]
        for _index, rollout_id, reason in rejections:  # before any drop, as NeMo RL prints them
            rejection_log.info("finalize: rollout %s rejected (%s) — placeholder", rollout_id, reason)
        all_keys = [key for row in rows for key in row.staging_keys]
        metrics.update(self._group_metrics(rows))
        min_wv = min((r.min_wv for r in valid_rows), default=fallback_weight_version)
        max_wv = max((r.max_wv for r in valid_rows), default=fallback_weight_version)

        t1 = time.perf_counter()
        # Structural drop: nothing can shape a route tensor for an all-placeholder group yet.
        if cfg.direct_routes and not valid_rows and settled.dims is None:
            metrics["finalize/group_dropped"] = 1.0
            return FinalizedGroup(group_id, [], min_wv, max_wv, [], all_keys, 0, metrics, 0, 0,
                                  dropped=True, drop_reason=DROP_NO_ROUTE_DIMS, rejections=rejections)
        sample_ids = [f"{group_id}_g{i}" for i in range(n)]
        if canonical_sample_ids is not None and list(canonical_sample_ids) != sample_ids:
            raise ValueError("canonical sample ids must equal the stable logical rollout ids: "
                             f"{sample_ids} != {list(canonical_sample_ids)}")
        out_rows = self._tensorize(group_id, rows, sample_ids, min_wv, max_wv, prompt_idx,
                                   mask_sample, loss_multiplier)
        route_dims = self._attach_group_routes(out_rows, rows, metrics, settled)
        self._attach_group_media(out_rows, rows)
        if cfg.router_replay and cfg.defer_routes:
            self._attach_plans(out_rows, rows, metrics)
        metrics["row_assembly/tensorize_ms"] = (time.perf_counter() - t1) * 1e3
        if group_labels:
            try:  # rows are already built: a bad label input must not lose the group
                metrics.update(group_label_stats(
                    labels=list(group_labels), rewards=[r.reward for r in rows],
                    valid=[r.valid for r in rows], mask_sample=list(mask_sample),
                    token_masks=[r.token_mask for r in rows],
                    seq_lens=[len(r.token_ids) for r in rows],
                    truncated=[cfg.max_seq_len is not None and len(r.token_ids) == cfg.max_seq_len
                               for r in rows],
                    calls=[len(r.staging_keys) for r in rows], result_stats=list(result_stats)))
            except Exception as error:  # noqa: BLE001 - per-label metrics are best effort
                logger.warning("finalize: group %s per-label metrics skipped (%s: %s)",
                               group_id, type(error).__name__, error)
        output_tokens = int(sum(int(np.count_nonzero(r.token_mask)) for r in valid_rows))
        return FinalizedGroup(
            group_id=group_id, rows=out_rows, group_min_wv=min_wv, group_max_wv=max_wv,
            staging_keys=all_keys if cfg.router_replay and cfg.defer_routes else [],
            cleanup_staging_keys=all_keys, canonical_output_tokens=output_tokens,
            metrics=metrics, valid_row_count=len(valid_rows), total_row_count=n,
            rejections=rejections, route_dims=route_dims)

    def _settle_route_dims(self, rows: list[FinalizedRollout]) -> tuple[list[FinalizedRollout], GroupDims]:
        """Direct mode: the group's route tensor has one (L, K): the configured dims, else the
        agreed ones, else those most of its routed rows carry (stage.routes.dims). A valid row
        whose routes have other dims is rejected (NeMo RL raises), and so is every valid row
        while the dims are unknown (NeMo RL raises for a valid row without routes then), and a
        valid row without routes while the dims are only its siblings' (not agreed): one
        rollout's dims never shape another rollout's row."""
        settled = self.dims_cache.settle([tuple(r.routed_experts.shape[1:]) for r in rows
                                          if r.valid and r.routed_experts is not None])
        dims = settled.dims
        out = []
        for row in rows:
            reason = None
            if not row.valid:
                pass
            elif dims is None or (row.routed_experts is None and not settled.agreed):
                reason = R.ROUTE_DIMS_UNKNOWN
            elif row.routed_experts is not None and tuple(row.routed_experts.shape[1:]) != tuple(dims):
                reason = R.reason(R.ROUTE_ASSEMBLY, ROUTE_FAILURE_MODEL_SHAPE)
            out.append(row if reason is None else _demote(row, reason))
        return out, settled

    # -- metrics -----------------------------------------------------------------------------
    @staticmethod
    def _group_metrics(rows: list[FinalizedRollout]) -> dict[str, float]:
        n = len(rows)
        valid = [r for r in rows if r.valid]
        m = {
            "finalize/invalid_row_rate": 1.0 - len(valid) / n,
            "finalize/calls_per_rollout": sum(len(r.staging_keys) for r in rows) / n,
            "finalize/media_row_rate": (sum(1 for r in valid if r.media is not None) / len(valid)
                                        if valid else 0.0),
        }
        # From each receipt as finalize_rollout parsed it: the same whatever form it came in.
        m.update(group_receipt_metrics([r.facts for r in rows], TERMINAL_SELECTIONS))
        for row in rows:
            if not row.valid:
                key = f"finalize/capture_failure_reason_{R.bucket_of(row.rejection_reason)}_count"
                m[key] = m.get(key, 0.0) + 1.0
        return m

    # -- tensorization -----------------------------------------------------------------------
    def _tensorize(self, group_id, rows, sample_ids, min_wv, max_wv, prompt_idx, mask_sample,
                   loss_multiplier) -> list[CanonicalRow]:
        cfg = self.config
        device = resolve_device(cfg.device)
        pad = cfg.pad_token_id
        first_valid = next((r for r in rows if r.valid), None)
        prompt = first_valid.token_ids[:first_valid.prompt_len] if first_valid is not None else None
        if prompt is None or not len(prompt):
            prompt = np.array([pad], dtype=np.int64)
        prompt_t = torch.as_tensor(prompt, dtype=torch.int64, device=device)
        out = []
        for i, (row, sid) in enumerate(zip(rows, sample_ids)):
            if row.valid:
                ids = torch.as_tensor(row.token_ids, dtype=torch.int64, device=device)
                mask = torch.as_tensor(row.token_mask, dtype=torch.float32, device=device)
                lps = torch.as_tensor(row.logprobs, dtype=torch.float32, device=device)
            else:
                ids = torch.full((1,), pad, dtype=torch.int64, device=device)
                mask = torch.zeros(1, dtype=torch.float32, device=device)
                lps = torch.zeros(1, dtype=torch.float32, device=device)
            length = int(ids.shape[0])
            topk_ids = topk_lps = None
            if cfg.top_logprobs > 0:
                k = cfg.top_logprobs
                if row.valid:
                    topk_ids = torch.as_tensor(row.topk_ids, dtype=torch.int32, device=device)
                    topk_lps = torch.as_tensor(row.topk_logprobs, dtype=torch.float32, device=device)
                else:
                    topk_ids = torch.zeros((1, k), dtype=torch.int32, device=device)
                    topk_lps = torch.zeros((1, k), dtype=torch.float32, device=device)
            out.append(CanonicalRow(
                group_id=group_id, sample_id=sid, row_index=i, group_size=len(rows),
                prompt_idx=prompt_idx, rollout_id=row.rollout_id, weight_version=min_wv,
                group_max_wv=max_wv, valid=row.valid, rejection_reason=row.rejection_reason,
                input_ids=ids, input_lengths=length, generation_logprobs=lps, token_mask=mask,
                sample_mask=float(loss_multiplier) if row.valid else 0.0,
                prompt_ids_for_adv=prompt_t, total_reward=float(np.float32(row.reward)),
                mask_sample=bool(mask_sample[i]),
                truncated=cfg.max_seq_len is not None and length == cfg.max_seq_len,
                staging_keys=list(row.staging_keys), generation_topk_ids=topk_ids,
                generation_topk_logprobs=topk_lps))
        return out

    def _attach_group_routes(self, out_rows, rows, metrics, settled) -> tuple[int, int] | None:
        """Direct mode: each row's routes (a placeholder's: its one -1 token); returns the dims
        the group tensor is built with (FinalizedGroup.routed_experts, on first use)."""
        if not self.config.direct_routes:
            return None
        lengths = [len(r.token_ids) if r.valid else 0 for r in rows]
        routes, route_metrics = group_route_rows(
            [r.routed_experts for r in rows], lengths, settled.dims,
            valid=[r.valid for r in rows], rollout_ids=[r.rollout_id for r in rows],
            device=self.config.device)
        metrics.update(route_metrics)
        layers, topk = settled.dims
        device = resolve_device(self.config.device)
        for row, own in zip(out_rows, routes):
            row.routed_experts = own if own is not None else torch.full(
                (row.input_lengths, layers, topk), -1, dtype=torch.int16, device=device)
        return settled.dims

    def _attach_group_media(self, out_rows, rows) -> None:
        device = resolve_device(self.config.device)
        own = [media_tensors(r.media, device) if r.valid and r.media is not None else None for r in rows]
        fields = group_media_rows(own)
        if fields is not None:
            for row, media in zip(out_rows, fields):
                row.media = media

    def _attach_plans(self, out_rows, rows, metrics) -> None:
        spans = encoded = covered = 0
        for row, source in zip(out_rows, rows):
            plan = source.route_plan if source.valid else None
            if plan is None:
                plan = placeholder_route_plan(
                    staging_partition=self.config.staging_partition,
                    cleanup_staging_keys=source.staging_keys,
                    expected_token_length=row.input_lengths,
                    schema_version=self.config.route_plan_schema_version)
            elif plan.spans:
                covered += 1
            row.route_plan = plan
            spans += len(plan.spans)
            encoded += validated_route_plan_size_bytes(plan)   # built validated
        metrics["finalize/route_plan_span_count"] = float(spans)
        metrics["finalize/route_plan_encoded_bytes"] = float(encoded)
        valid = sum(1 for r in rows if r.valid)
        if valid:
            metrics["finalize/routed_experts_row_coverage"] = covered / valid


def pad_group(group: FinalizedGroup, *, pad_token_id: int = 0, device=None) -> dict[str, torch.Tensor]:
    """NeMo RL's training tensors from jagged rows: input_ids int64 [n, max_len] padded with
    ``pad_token_id``, generation_logprobs/token_mask float32 [n, max_len] (0 padded),
    input_lengths int64 [n], sample_mask/total_reward float32 [n], mask_sample/truncated bool
    [n], prompt_ids_for_adv int64 [n, p], plus routed_experts int16 [n, max_len, L, K] (-1
    padded) and top-k [n, max_len, k] (0 padded) when the rows carry them, and in a group with
    media pixel_values / imgs_sizes / num_frames concatenated over the rows with their
    ``<field>__row_counts`` (``group_media.pad_group_media``)."""
    rows = group.rows
    if not rows:
        raise ValueError(f"group {group.group_id} has no rows (dropped: {group.drop_reason})")
    target = resolve_device(device) if device is not None else rows[0].input_ids.device
    n, max_len = len(rows), max(r.input_lengths for r in rows)

    def stack(column: str, fill, dtype, tail=()):
        out = torch.full((n, max_len, *tail), fill, dtype=dtype, device=target)
        for i, row in enumerate(rows):
            value = getattr(row, column)
            out[i, :row.input_lengths] = value.to(device=target, dtype=dtype)
        return out

    tensors = {
        "input_ids": stack("input_ids", pad_token_id, torch.int64),
        "input_lengths": torch.tensor([r.input_lengths for r in rows], dtype=torch.int64, device=target),
        "generation_logprobs": stack("generation_logprobs", 0.0, torch.float32),
        "token_mask": stack("token_mask", 0.0, torch.float32),
        "sample_mask": torch.tensor([r.sample_mask for r in rows], dtype=torch.float32, device=target),
        "prompt_ids_for_adv": torch.stack([r.prompt_ids_for_adv.to(target) for r in rows]),
        "total_reward": torch.tensor([r.total_reward for r in rows], dtype=torch.float32, device=target),
        "mask_sample": torch.tensor([r.mask_sample for r in rows], dtype=torch.bool, device=target),
        "truncated": torch.tensor([r.truncated for r in rows], dtype=torch.bool, device=target),
    }
    if rows[0].routed_experts is not None:
        layers, topk = rows[0].routed_experts.shape[1:]
        tensors["routed_experts"] = stack("routed_experts", -1, torch.int16, (layers, topk))
    if rows[0].generation_topk_ids is not None:
        k = rows[0].generation_topk_ids.shape[1]
        tensors["generation_topk_ids"] = stack("generation_topk_ids", 0, torch.int32, (k,))
        tensors["generation_topk_logprobs"] = stack("generation_topk_logprobs", 0.0, torch.float32, (k,))
    tensors.update(pad_group_media([r.media for r in rows], target))
    return tensors
