"""One prompt group being joined: its receipts by rollout index, its staged calls by key, its
route chunks (direct router replay) by (staging_key, offset), and the group-level fields its
first receipt established."""

from __future__ import annotations

from dataclasses import dataclass, field

from stage.buffer.fields import GroupFields, aggregate_result_stats
from stage.buffer.items import ReceiptItem, RouteChunkItem, StagedItem

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
    # Direct router replay: route chunks by (staging_key, offset in the route topic).
    chunks: dict[tuple[str, int], RouteChunkItem] = field(default_factory=dict)
    status: str = OPEN
    nbytes: int = 0                # held in memory
    spilled_bytes: int = 0         # of its staged records, on local disk (stage.buffer.spill)
    last_timestamp_ms: int = 0
    # The lowest offset per input topic this group still needs (for the commit watermark).
    min_offsets: dict[str, int] = field(default_factory=dict)
    max_offsets: dict[str, int] = field(default_factory=dict)
    _missing_keys: set[str] | None = None
    _missing_chunks: set[tuple[str, int]] | None = None

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

    def missing_chunks(self) -> set[tuple[str, int]]:
        """The route chunks (staging_key, offset) its staged calls' references name and the
        group does not hold (direct router replay; empty otherwise)."""
        if self._missing_chunks is None:
            self._missing_chunks = {key for item in self.staged.values() for key in item.route_keys()
                                    if key not in self.chunks}
        return self._missing_chunks

    def unreferenced_chunks(self) -> int:
        """Route chunks no staged call's reference names (dropped with the group)."""
        named = {key for item in self.staged.values() for key in item.route_keys()}
        return sum(1 for key in self.chunks if key not in named)

    def invalidate(self) -> None:
        self._missing_keys = None

    @property
    def complete(self) -> bool:
        """All N receipts are in, every staged row their manifests name is present, and every
        route chunk those rows reference (direct router replay)."""
        return (self.group_size is not None and len(self.receipts) == self.group_size
                and not self.missing_keys() and not self.missing_chunks())
