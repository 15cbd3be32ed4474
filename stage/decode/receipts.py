"""ReceiptEvent (Avro dict) -> ReceiptItem. Structural checks only: a receipt that is
well-formed on the wire but fails Gym's rules becomes a placeholder row later (invalid_receipt),
not a dead letter."""

from __future__ import annotations

import math
import sys

from stage.buffer import Position, ReceiptItem
from stage.decode.errors import DecodeError
from stage.decode.limits import InputLimits
from stage.staging import fits_float32


def _identifier(value, field: str, limits: InputLimits) -> str:
    if not isinstance(value, str) or not value:
        raise DecodeError("must be a non-empty string", field=field)
    if len(value) > limits.max_id_chars:
        raise DecodeError(f"longer than {limits.max_id_chars} characters", field=field)
    return value


def _name(value: str, field: str, limits: InputLimits) -> str:
    if len(value) > limits.max_name_chars:
        raise DecodeError(f"longer than {limits.max_name_chars} characters", field=field)
    return value


def _labels(labels: list, limits: InputLimits) -> tuple[tuple[str, str], ...]:
    if len(labels) > limits.max_labels:
        raise DecodeError(f"{len(labels)} labels, more than {limits.max_labels}", field="labels")
    return tuple((_name(label["scope"], f"labels[{i}].scope", limits),
                  _name(label["name"], f"labels[{i}].name", limits)) for i, label in enumerate(labels))


def _result_stats(stats: list, limits: InputLimits) -> tuple[tuple[str, float, int], ...]:
    """One rollout's (field, sum, count): each field once (the group sums receipts, not a
    receipt's own repeats), a finite sum and a count >= 0."""
    if len(stats) > limits.max_result_stats:
        raise DecodeError(f"{len(stats)} entries, more than {limits.max_result_stats}",
                          field="result_stats")
    seen: dict[str, int] = {}
    for i, stat in enumerate(stats):
        name = _name(stat["field"], f"result_stats[{i}].field", limits)
        if name in seen:
            raise DecodeError(f"{name!r} listed twice (also result_stats[{seen[name]}])",
                              field=f"result_stats[{i}].field")
        seen[name] = i
        if not math.isfinite(stat["sum"]):
            raise DecodeError(f"must be finite, got {stat['sum']!r}", field=f"result_stats[{i}].sum")
        # the group sums up to max_group_size of these: bounded so that the sum stays finite
        bound = sys.float_info.max / limits.max_group_size
        if abs(stat["sum"]) > bound:
            raise DecodeError(f"must be at most {bound:.3g} in magnitude (a group of up to "
                              f"{limits.max_group_size} receipts sums it), got {stat['sum']!r}",
                              field=f"result_stats[{i}].sum")
        if stat["count"] < 0:
            raise DecodeError(f"must be >= 0, got {stat['count']!r}", field=f"result_stats[{i}].count")
    return tuple((s["field"], float(s["sum"]), int(s["count"])) for s in stats)


def receipt_item(record: dict, position: Position, nbytes: int,
                 limits: InputLimits = InputLimits()) -> ReceiptItem:
    group_id = _identifier(record.get("group_id"), "group_id", limits)
    rollout_id = _identifier(record.get("rollout_id"), "rollout_id", limits)
    size, index = record.get("group_size"), record.get("rollout_index")
    if not isinstance(size, int) or not 0 < size <= limits.max_group_size:
        raise DecodeError(f"must be in 1..{limits.max_group_size}, got {size!r}", field="group_size")
    if not isinstance(index, int) or not 0 <= index < size:
        raise DecodeError(f"must be in 0..{size - 1}, got {index!r}", field="rollout_index")
    for name in ("reward", "loss_multiplier"):
        value = record.get(name, 0.0)
        if not fits_float32(value):
            raise DecodeError(f"must be finite and within float32 range (|x| <= 3.4028235e38, the "
                              f"published width), got {value!r}", field=name)
    receipt = record.get("receipt")
    if receipt is not None:
        manifest = receipt.get("manifest", [])
        if len(manifest) > limits.max_manifest_calls:
            raise DecodeError(f"names {len(manifest)} calls, more than {limits.max_manifest_calls}",
                              field="receipt.manifest")
    canonical = record.get("canonical_sample_id")
    expected = f"{group_id}_g{index}"
    if canonical is not None and canonical != expected:
        raise DecodeError(f"must be {expected!r}, got {canonical!r}", field="canonical_sample_id")
    return ReceiptItem(
        group_id=group_id, rollout_id=rollout_id, rollout_index=index, group_size=size,
        prompt_idx=record["prompt_idx"], reward=float(record["reward"]), receipt=receipt,
        position=position, nbytes=nbytes, mask_sample=bool(record.get("mask_sample", False)),
        loss_multiplier=float(record.get("loss_multiplier", 1.0)),
        fallback_weight_version=int(record.get("fallback_weight_version", 0)),
        canonical_sample_id=canonical,
        labels=_labels(record.get("labels", []), limits),
        result_stats=_result_stats(record.get("result_stats", []), limits))
