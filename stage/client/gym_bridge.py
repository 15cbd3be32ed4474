"""Bridge for an existing NeMo Gym deployment: Gym's own JSON records onto the input topics.

Gym's worker already stages ``StagedCallRecord`` JSON (token columns, digests, extras) and its
rollout owner already writes ``RolloutReceipt`` JSON. The bridge loads each with the contract's
Gym-compatible loaders (the same field and model rules, so a record Gym would refuse is refused
here, with Gym's message) and publishes it unchanged in meaning: the staged record is split the
way the stage stores it (route envelope -> packed tensor, extras metadata -> canonical JSON),
which the extras digest still binds; the receipt travels field for field inside a ReceiptEvent::

    bridge = GymBridge(StagingProducer("broker:9092"))
    for record_json in gym_staged_records:                 # dict, str or bytes
        bridge.publish_staged_record(group_id, record_json)
    bridge.publish_receipt(group_id, receipt_json, rollout_index=i, group_size=n,
                           prompt_idx=p, reward=r)
    bridge.producer.flush()
"""

from __future__ import annotations

from stage.client.producer import StagingProducer
from stage.client.records import receipt_event, staged_call_from_record
from stage.contract import RolloutReceipt, StagedCallRecord
from stage.finalize import StagedMedia, TopK


class GymBridge:
    def __init__(self, producer: StagingProducer) -> None:
        self.producer = producer

    def publish_staged_record(self, group_id: str, record, *, media: StagedMedia | None = None,
                              topk: TopK | None = None) -> str:
        """One Gym ``StagedCallRecord`` (JSON dict/str/bytes, or the record) -> the staged-calls
        topic. Returns its staging key. WireValidationError if Gym's rules refuse it."""
        if not isinstance(record, StagedCallRecord):
            record = StagedCallRecord.from_json(record)
        value = staged_call_from_record(group_id, record, media=media, topk=topk)
        self.producer.send_staged(group_id, value)
        return value["staging_key"]

    def publish_receipt(self, group_id: str, receipt, *, rollout_index: int, group_size: int,
                        prompt_idx: int, reward: float | None = None, rollout_id: str | None = None,
                        mask_sample: bool = False, loss_multiplier: float = 1.0,
                        fallback_weight_version: int = 0, labels=(), result_stats=()) -> dict:
        """One Gym ``RolloutReceipt`` (JSON dict/str/bytes, the record, or None for a rollout
        that produced none) -> the receipts topic. ``reward`` defaults to the receipt's own.
        Returns the ReceiptEvent value sent."""
        if receipt is not None and not isinstance(receipt, RolloutReceipt):
            receipt = RolloutReceipt.from_json(receipt)
        if receipt is None and rollout_id is None:
            raise ValueError("a missing receipt needs the rollout_id")
        if reward is None:
            reward = receipt.reward if receipt is not None and receipt.reward is not None else 0.0
        value = receipt_event(
            group_id=group_id, rollout_id=rollout_id or receipt.rollout_id,
            rollout_index=rollout_index, group_size=group_size, prompt_idx=prompt_idx,
            reward=reward, receipt=receipt, mask_sample=mask_sample,
            loss_multiplier=loss_multiplier, fallback_weight_version=fallback_weight_version,
            canonical_sample_id=f"{group_id}_g{rollout_index}", labels=labels,
            result_stats=result_stats)
        self.producer.send_receipt(group_id, value)
        return value


__all__ = ["GymBridge"]
