"""Producer-side staging (Gym section 7.2/7.4): build the staged record and manifest row of a
model call from its engine sequences, with Gym's digests, chain and cumulative hashes.

``RolloutBuilder`` keeps each call's delta and its parent link, so a child hashes its
cumulative prefix (the ancestors' deltas, concatenated) without re-reading staging; it is what
the SDK, the synthetic workload and the tests use. Extras may hold ``RouteEnvelope`` values
where Gym has envelope strings: the digest streams them, and the Gym record (``.record``, with
the strings written out) is built only when someone asks for it.
"""

from __future__ import annotations

import numpy as np

from .digests import compute_chain_hash, compute_extras_digest, compute_staging_digest, hash_token_ids
from .records import (
    CallRecord,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    default_staging_key,
)
from .routes import RouteEnvelope


def _has_envelopes(extras) -> bool:
    return extras is not None and any(type(v) is RouteEnvelope for v in extras.values())


class StagedCall:
    """One staged call: the validated base snapshot, the extras it commits to, its manifest row."""

    __slots__ = ("snapshot", "extras", "manifest_row", "parent", "_record")

    def __init__(self, snapshot: StagedCallBaseSnapshot, extras, manifest_row: CallRecord,
                 parent: "StagedCall | None", record: StagedCallRecord | None = None) -> None:
        self.snapshot = snapshot          # token columns + metadata, digest checked
        self.extras = extras              # as digested (RouteEnvelope values allowed)
        self.manifest_row = manifest_row  # token-free, goes into the receipt
        self.parent = parent
        self._record = record

    @property
    def record(self) -> StagedCallRecord:
        """Gym's token-bearing record (extras with envelope strings), built on first use."""
        if self._record is None:
            extras = None if self.extras is None else {
                k: v.text() if type(v) is RouteEnvelope else v for k, v in self.extras.items()}
            values = {f[0]: getattr(self.snapshot, f[0]) for f in StagedCallBaseSnapshot.FIELDS}
            self._record = StagedCallRecord.construct(**values, extras=extras)
        return self._record

    def base_snapshot(self) -> StagedCallBaseSnapshot:
        """A fresh copy of the base snapshot (callers may mutate it, e.g. to test the verifier)."""
        values = {f[0]: getattr(self.snapshot, f[0]) for f in StagedCallBaseSnapshot.FIELDS}
        return StagedCallBaseSnapshot.construct(**values)

    @property
    def full_token_ids(self) -> np.ndarray:
        """The engine's prompt + generation (cum_len tokens): the chain's deltas, root first."""
        deltas, node = [], self
        while node is not None:
            deltas.append(node.snapshot.token_ids_delta)
            node = node.parent
        return np.concatenate(deltas[::-1])


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
        delta = np.concatenate([prompt_delta, generated])
        mask = np.concatenate([np.zeros(len(prompt_delta)), np.ones(len(generated))])
        lps = np.concatenate([np.zeros(len(prompt_delta)), logprobs])
        full = np.concatenate([parent.full_token_ids, delta]) if parent else delta
        prev_len = len(full) - len(delta)
        fields = dict(
            schema_version=2, digest_version=2, extras_digest_version=1,
            rollout_id=self.rollout_id, model_call_id=model_call_id,
            parent_call_id=parent_call_id, mode="text" if parent is None else "token_in",
            prev_len=prev_len, delta_len=len(delta), cum_len=prev_len + len(delta),
            weight_version=weight_version, token_ids_delta=delta, token_mask_delta=mask,
            generation_log_probs_delta=lps, extras_digest=compute_extras_digest(extras),
            chain_hash=compute_chain_hash(parent.snapshot.chain_hash if parent else None, delta),
            cumulative_hash=hash_token_ids(full))
        digest = compute_staging_digest(**fields)
        if _has_envelopes(extras):
            # Validate what Gym's record validation checks except the extras digest, which was
            # just computed from these very extras (recomputing it would hash the routes again).
            snapshot, record = StagedCallBaseSnapshot(**fields, digest=digest), None
        else:
            record = StagedCallRecord(**fields, digest=digest, extras=extras)
            snapshot = record.base_snapshot()
        row = CallRecord(
            model_call_id=model_call_id, parent_call_id=parent_call_id, prev_len=prev_len,
            delta_len=len(delta), cum_len=prev_len + len(delta), weight_version=weight_version,
            digest=digest, extras_digest=fields["extras_digest"],
            staging_key=staging_key or default_staging_key(self.rollout_id, model_call_id),
            mode=fields["mode"], chain_hash=fields["chain_hash"],
            cumulative_hash=fields["cumulative_hash"],
            response_id=response_id or f"resp-{model_call_id}", admitted_at=admitted_at)
        staged = StagedCall(snapshot, extras, row, parent, record)
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
        return [self.calls[c].base_snapshot() for c in order]
