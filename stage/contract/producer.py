"""Producer-side staging (Gym section 7.2/7.4): build the staged record and manifest row of a
model call from its engine sequences, with Gym's digests, chain and cumulative hashes.

``RolloutBuilder`` keeps each call's full sequence so children hash their cumulative prefix
without re-reading ancestors; it is what the SDK, the synthetic workload and the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .digests import compute_chain_hash, compute_extras_digest, compute_staging_digest, hash_token_ids
from .records import CallRecord, RolloutReceipt, StagedCallRecord, default_staging_key


@dataclass(frozen=True)
class StagedCall:
    record: StagedCallRecord   # token-bearing, goes to staging storage
    manifest_row: CallRecord   # token-free, goes into the receipt
    full_token_ids: np.ndarray  # the engine's prompt + generation (cum_len tokens)


class RolloutBuilder:
    """Stage the calls of one rollout in admission order (stage-before-ack: parents first)."""

    def __init__(self, rollout_id: str) -> None:
        self.rollout_id = rollout_id
        self.calls: dict[str, StagedCall] = {}

    def stage(self, model_call_id: str, *, parent_call_id: str | None, prompt_delta, generated,
              generated_logprobs, weight_version: int, extras=None, staging_key: str | None = None,
              response_id: str | None = None, admitted_at: float | None = None) -> StagedCall:
        """Stage one call whose prompt is the parent's full sequence plus ``prompt_delta``."""
        prompt_delta = np.asarray(prompt_delta, dtype=np.uint64)
        generated = np.asarray(generated, dtype=np.uint64)
        logprobs = np.asarray(generated_logprobs, dtype=np.float64)
        if len(logprobs) != len(generated):
            raise ValueError("generated tokens and logprobs must have equal lengths")
        parent = self.calls[parent_call_id] if parent_call_id is not None else None
        prefix = parent.full_token_ids if parent else np.empty(0, np.uint64)
        delta = np.concatenate([prompt_delta, generated])
        mask = np.concatenate([np.zeros(len(prompt_delta)), np.ones(len(generated))])
        lps = np.concatenate([np.zeros(len(prompt_delta)), logprobs])
        full = np.concatenate([prefix, delta])
        prev_len = len(prefix)
        fields = dict(
            schema_version=2, digest_version=2, extras_digest_version=1,
            rollout_id=self.rollout_id, model_call_id=model_call_id,
            parent_call_id=parent_call_id, mode="text" if parent is None else "token_in",
            prev_len=prev_len, delta_len=len(delta), cum_len=prev_len + len(delta),
            weight_version=weight_version, token_ids_delta=delta, token_mask_delta=mask,
            generation_log_probs_delta=lps, extras_digest=compute_extras_digest(extras),
            chain_hash=compute_chain_hash(parent.record.chain_hash if parent else None, delta),
            cumulative_hash=hash_token_ids(full))
        digest = compute_staging_digest(**fields)
        record = StagedCallRecord(**fields, digest=digest, extras=extras)
        row = CallRecord(
            model_call_id=model_call_id, parent_call_id=parent_call_id, prev_len=prev_len,
            delta_len=len(delta), cum_len=prev_len + len(delta), weight_version=weight_version,
            digest=digest, extras_digest=fields["extras_digest"],
            staging_key=staging_key or default_staging_key(self.rollout_id, model_call_id),
            mode=fields["mode"], chain_hash=fields["chain_hash"],
            cumulative_hash=fields["cumulative_hash"],
            response_id=response_id or f"resp-{model_call_id}", admitted_at=admitted_at)
        staged = StagedCall(record, row, full)
        self.calls[model_call_id] = staged
        return staged

    def receipt(self, terminal_model_call_id: str, *, order=None, reward=None,
                terminal_selection: str = "declared") -> RolloutReceipt:
        """A trainable receipt naming every staged call (in ``order`` if given)."""
        order = list(self.calls) if order is None else list(order)
        return RolloutReceipt(
            rollout_id=self.rollout_id, reward=reward, terminal_model_call_id=terminal_model_call_id,
            manifest=[self.calls[c].manifest_row for c in order],
            terminal_selection=terminal_selection)

    def snapshots(self, order=None) -> list:
        order = list(self.calls) if order is None else list(order)
        return [self.calls[c].record.base_snapshot() for c in order]
