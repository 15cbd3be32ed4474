"""Which ReceiptEvent fields belong to the prompt group and which to one rollout.

NeMo RL's ReassemblyRequest carries one value per group for ``group_size`` (N),
``prompt_idx``, ``loss_multiplier``, ``fallback_weight_version`` and ``group_labels``; every
receipt repeats them. The first receipt read establishes them; a later receipt that
contradicts any of them never joins the group (the runtime dead-letters it with the text
``conflict_text`` returns). Everything else (rollout_id, rollout_index, reward, mask_sample,
canonical_sample_id, receipt, result_stats) is the rollout's own; ``result_stats`` are summed
over the group's receipts (``aggregate_result_stats``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from stage.buffer.items import ReceiptItem

# Distinct result_stats fields a group may name across its receipts: the per-label
# result_sum/result_count metrics grow with labels x fields, and the GroupSummary is capped.
MAX_GROUP_RESULT_FIELDS = 128


@dataclass(frozen=True)
class GroupFields:
    """A group's group-level fields, as its first receipt stated them."""

    group_size: int
    prompt_idx: int
    loss_multiplier: float
    fallback_weight_version: int
    # (scope, name) pairs: a set (order and repeats carry no meaning for per-label stats);
    # kept in the first receipt's order, repeats dropped, so the metrics map is stable.
    labels: tuple[tuple[str, str], ...]
    established_by: int            # rollout_index of the receipt that stated them

    @classmethod
    def of(cls, item: ReceiptItem) -> "GroupFields":
        return cls(item.group_size, item.prompt_idx, item.loss_multiplier,
                   item.fallback_weight_version, tuple(dict.fromkeys(item.labels)),
                   item.rollout_index)


def conflict_text(fields: GroupFields, item: ReceiptItem) -> str | None:
    """Why ``item`` cannot join the group whose fields are ``fields`` (None: it can).

    Exact comparison throughout: the producer repeats the same value in every receipt, so a
    loss_multiplier that differs by one ulp is a different value (IEEE ``==``: no tolerance;
    NaN cannot reach here, the decoder refuses non-finite values)."""
    checks = (("group_size", item.group_size, fields.group_size),
              ("prompt_idx", item.prompt_idx, fields.prompt_idx),
              ("loss_multiplier", item.loss_multiplier, fields.loss_multiplier),
              ("fallback_weight_version", item.fallback_weight_version,
               fields.fallback_weight_version))
    for name, theirs, ours in checks:
        if theirs != ours:
            return _text(item, fields, f"{name} {theirs!r} != {ours!r}")
    if set(item.labels) != set(fields.labels):
        return _text(item, fields, f"labels {_labels(item.labels)} != {_labels(fields.labels)}")
    return None


def result_fields_text(known: set[str], item: ReceiptItem) -> str | None:
    """Why ``item`` would name too many distinct result_stats fields for its group (None: fine)."""
    names = known | {field for field, _sum, _count in item.result_stats}
    if len(names) <= MAX_GROUP_RESULT_FIELDS:
        return None
    return (f"conflicts with group {item.group_id}: result_stats would name {len(names)} distinct "
            f"fields across the group, more than {MAX_GROUP_RESULT_FIELDS}")


def aggregate_result_stats(receipts: Iterable[ReceiptItem]) -> tuple[tuple[str, float, int], ...]:
    """The group's (field, sum, count): per field, the sum of the receipts' sums and of their
    counts. Pass the receipts in rollout-index order: float addition is not associative, and the
    same group must publish the same summary whatever order its records were read in."""
    totals: dict[str, list] = {}
    for item in receipts:
        for field, total, count in item.result_stats:
            entry = totals.setdefault(field, [0.0, 0])
            entry[0] += total
            entry[1] += count
    return tuple((field, total, count) for field, (total, count) in totals.items())


def _labels(labels) -> str:
    return repr(sorted({tuple(label) for label in labels}))


def _text(item: ReceiptItem, fields: GroupFields, detail: str) -> str:
    return (f"conflicts with group {item.group_id}: {detail} "
            f"(first receipt rollout_index {fields.established_by})")
