"""Fault injection for the synthetic workload: which faults exist, what each does to the
records, and the rejection the stage must give the row it hits. Pure (no Kafka).

Rollout faults (at most one per rollout):

| fault | what happens | the row |
|---|---|---|
| ``tampered_tokens`` | one token of one staged call changes in transit; its digest does not | ``invalid_staging_row:`` (the staged row fails Gym's digest rule when the stage loads it) |
| ``tampered_digest`` | the receipt's manifest names another digest for one call | ``rebuild_failed:wrong_digest: call ...`` (Gym's verifier) |
| ``poisoned_receipt`` | the rollout owner marks token capture as poisoned | ``capture_poisoned`` |
| ``missing_receipt`` | the rollout owner emits a missing-receipt event | ``missing_receipt`` (at once) |
| ``missing_staged`` | one staged call never reaches the topic | ``missing_staging_row:`` (at the group deadline) |
| ``late_receipt`` | the receipt is sent only after its group was published | ``missing_receipt`` at the deadline; the late receipt is counted and skipped |

``garbage`` is per group: one record of undecodable bytes on an input topic, which the stage
must dead-letter untouched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from stage.contract import StagedCallRecord
from stage.wire import pack_tensor, unpack_tensor

TAMPERED_TOKENS = "tampered_tokens"
TAMPERED_DIGEST = "tampered_digest"
POISONED_RECEIPT = "poisoned_receipt"
MISSING_RECEIPT = "missing_receipt"
MISSING_STAGED = "missing_staged"
LATE_RECEIPT = "late_receipt"
ROLLOUT_FAULTS = (TAMPERED_TOKENS, TAMPERED_DIGEST, POISONED_RECEIPT, MISSING_RECEIPT,
                  MISSING_STAGED, LATE_RECEIPT)
GARBAGE = "garbage"
# Faults that leave the group incomplete until its deadline.
DEADLINE_FAULTS = frozenset((MISSING_STAGED, LATE_RECEIPT))


@dataclass(frozen=True)
class FaultRates:
    """Probability that a rollout gets each fault (they exclude each other: the rates sum to
    at most 1), and that a group gets one garbage record."""

    tampered_tokens: float = 0.0
    tampered_digest: float = 0.0
    poisoned_receipt: float = 0.0
    missing_receipt: float = 0.0
    missing_staged: float = 0.0
    late_receipt: float = 0.0
    garbage: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"fault rate {f.name} must be in [0, 1], got {value}")
        if self.rollout_total > 1.0 + 1e-9:
            raise ValueError(f"rollout fault rates sum to {self.rollout_total:.3f} > 1")

    @property
    def rollout_total(self) -> float:
        return sum(getattr(self, name) for name in ROLLOUT_FAULTS)

    @classmethod
    def uniform(cls, rate: float, *, garbage: float | None = None) -> "FaultRates":
        """``rate`` for every rollout fault (and garbage, unless given)."""
        return cls(**{name: rate for name in ROLLOUT_FAULTS},
                   garbage=rate if garbage is None else garbage)

    def pick(self, rng: np.random.Generator) -> str | None:
        u = rng.random()
        for name in ROLLOUT_FAULTS:
            u -= getattr(self, name)
            if u < 0:
                return name
        return None


@dataclass(frozen=True)
class ExpectedRejection:
    """The reason a faulted row must carry: ``reason`` exactly, or (``exact=False``) a reason
    that starts with it and contains every string of ``contains``."""

    reason: str
    exact: bool = True
    contains: tuple[str, ...] = ()

    def matches(self, reason: str | None) -> bool:
        if reason is None:
            return False
        if self.exact:
            return reason == self.reason
        return reason.startswith(self.reason) and all(part in reason for part in self.contains)

    def __str__(self) -> str:
        if self.exact:
            return self.reason
        return self.reason + "..." + "".join(f" containing {part!r}" for part in self.contains)


def flip_token(ids: np.ndarray, position: int, vocab_size: int) -> np.ndarray:
    """A copy of ``ids`` with one token replaced by another in-vocabulary token."""
    out = np.array(ids, copy=True)
    out[position] = (int(out[position]) + 1) % vocab_size
    return out


def tamper_staged_value(value: dict, position: int, vocab_size: int) -> dict:
    """The StagedCall wire value with token ``position`` changed and everything else (the
    digest included) as staged: what a corrupted transport would deliver."""
    ids = unpack_tensor(value["token_ids_delta"], field="token_ids_delta")
    return {**value, "token_ids_delta": pack_tensor(flip_token(ids, position, vocab_size))}


def tamper_staged_record(record: StagedCallRecord, position: int, vocab_size: int) -> StagedCallRecord:
    """The same change on the Gym record (built without validation, as a transport would)."""
    values = {name: getattr(record, name) for name, _p, _d in StagedCallRecord.FIELDS}
    values["token_ids_delta"] = flip_token(record.token_ids_delta, position, vocab_size)
    return StagedCallRecord.construct(**values)


def tamper_manifest_digest(receipt_json: dict, model_call_id: str, digest: str) -> dict:
    manifest = [dict(row, digest=digest) if row["model_call_id"] == model_call_id else row
                for row in receipt_json["manifest"]]
    return {**receipt_json, "manifest": manifest}


def poison_receipt(receipt_json: dict) -> dict:
    return {**receipt_json, "capture_poisoned": True}
