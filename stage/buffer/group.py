"""One prompt group being joined: its receipts by rollout index, its staged calls by key, and
the group-level fields its first receipt established."""

from __future__ import annotations

from dataclasses import dataclass, field

from stage.buffer.fields import GroupFields, aggregate_result_stats
from stage.buffer.items import ReceiptItem, StagedItem

OPEN, IN_FLIGHT = "open", "in_flight"


@dataclass(eq=False)
class GroupState:
    group_id: str
    partition: int
    first_timestamp_ms: int        # earliest Kafka timestamp of the group's records
    deadline_ms: int               # earliest (timestamp, clamped to our clock) + group timeout
    fields: GroupFields | None = None   # set by the first receipt admitted
    result_fields: set[str] = field(default_factory=set)   # result_stats fields its receipts name
    receipts: dict[int, ReceiptItem] = field(default_factory=dict)
    staged: dict[str, StagedItem] = field(default_factory=dict)
    status: str = OPEN
    nbytes: int = 0                # held in memory
    spilled_bytes: int = 0         # of its staged records, on local disk (stage.buffer.spill)
    last_timestamp_ms: int = 0
    # The lowest offset per input topic this group still needs (for the commit watermark).
    min_offsets: dict[str, int] = field(default_factory=dict)
    max_offsets: dict[str, int] = field(default_factory=dict)
    _missing_keys: set[str] | None = None

    def note_position(self, topic: str, offset: int, timestamp_ms: int) -> None:
        if offset < self.min_offsets.get(topic, offset + 1):
            self.min_offsets[topic] = offset
        if offset > self.max_offsets.get(topic, -1):
            self.max_offsets[topic] = offset
        self.first_timestamp_ms = min(self.first_timestamp_ms, timestamp_ms)
        self.last_timestamp_ms = max(self.last_timestamp_ms, timestamp_ms)

    @property
    def group_size(self) -> int | None:
        return None if self.fields is None else self.fields.group_size

    def result_stats(self) -> tuple[tuple[str, float, int], ...]:
        """(field, sum, count) summed over every receipt the group holds, in rollout order."""
        return aggregate_result_stats(self.receipts[i] for i in sorted(self.receipts))

    def named_keys(self) -> set[str]:
        return {key for item in self.receipts.values() for key in item.staging_keys}

    def missing_keys(self) -> set[str]:
        if self._missing_keys is None:
            self._missing_keys = self.named_keys() - self.staged.keys()
        return self._missing_keys

    def invalidate(self) -> None:
        self._missing_keys = None

    @property
    def complete(self) -> bool:
        """All N receipts are in and every staged row their manifests name is present."""
        return (self.group_size is not None and len(self.receipts) == self.group_size
                and not self.missing_keys())
