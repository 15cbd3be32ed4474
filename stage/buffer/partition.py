"""The buffer of one co-partitioned input partition (receipts p + staged calls p, + route
chunks p in direct router replay).

State only: no Kafka, no threads. The runtime feeds decoded records in, asks which groups are
ready (complete, or past their deadline), hands them to finalization, and after publication
asks which input offsets are safe to commit. A group's lifecycle: open -> in_flight (taken for
finalization; its records still hold the commit watermark) -> published (forgotten, but its id
is remembered so late and replayed records are skipped).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

from stage.buffer.duplicates import keep_digests, receipt_difference, staged_difference
from stage.buffer.fields import GroupFields, conflict_text, result_fields_text
from stage.buffer.group import IN_FLIGHT, OPEN, GroupState
from stage.buffer.items import ReceiptItem, RouteChunkItem, StagedItem

# What add_* did with a record (counted by the runtime).
ADDED = "added"
DUPLICATE = "duplicate"        # same rollout_index / staging_key and content already buffered
LATE = "late"                  # its group is in flight or already published
REPLAYED = "replayed"          # re-read after a restart; the ledger says its group is published
CONFLICT = "conflict"          # contradicts the group's fields (stage.buffer.fields) or its N, or
                               # repeats a buffered identity with other content (.duplicates)

COMPLETE = "complete"
DEADLINE = "deadline"


@dataclass(frozen=True)
class Published:
    """A group published from this partition (from this process or the ledger)."""

    max_offsets: dict
    published_at_ms: int
    from_ledger: bool = False


class PartitionBuffer:
    def __init__(self, partition: int, *, receipts_topic: str, staged_topic: str,
                 group_timeout_ms: int, late_retention_ms: int, spill=None,
                 routes_topic: str | None = None) -> None:
        self.partition = partition
        self.spill = spill                       # SpillStore, or None: every record in memory
        self.spilled_bytes = 0
        self.receipts_topic = receipts_topic
        self.staged_topic = staged_topic
        self.routes_topic = routes_topic         # direct router replay's third input, else None
        self.group_timeout_ms = group_timeout_ms
        self.late_retention_ms = late_retention_ms
        self.groups: dict[str, GroupState] = {}
        self.published: dict[str, Published] = {}
        self.next_offsets: dict[str, int] = {}   # one past the highest offset seen per topic
        self.stream_time: dict[str, int] = {}    # highest record timestamp seen per topic
        self.nbytes = 0
        self.largest_group_bytes = 0             # input of the largest group held, memory + spill
        self.counts: Counter = Counter()
        self._deadlines: list[tuple[int, str]] = []
        self._complete: set[str] = set()
        self.last_conflict: str | None = None    # why the last CONFLICT was one

    # -- intake ----------------------------------------------------------------------------
    def _group_for(self, group_id: str, timestamp_ms: int, now_ms: int) -> GroupState:
        group = self.groups.get(group_id)
        if group is None:
            group = GroupState(group_id, self.partition, timestamp_ms,
                               self._deadline_of(timestamp_ms, now_ms))
            self.groups[group_id] = group
            heapq.heappush(self._deadlines, (group.deadline_ms, group_id))
        return group

    def _deadline_of(self, timestamp_ms: int, now_ms: int) -> int:
        # A producer clock ahead of ours must not extend the deadline.
        return min(timestamp_ms, now_ms) + self.group_timeout_ms

    def skip(self, topic: str, offset: int, timestamp_ms: int = 0) -> None:
        """A record handled without buffering (dead-lettered): it no longer holds the watermark."""
        self._seen(topic, offset, timestamp_ms)

    def _seen(self, topic: str, offset: int, timestamp_ms: int) -> None:
        if offset + 1 > self.next_offsets.get(topic, 0):
            self.next_offsets[topic] = offset + 1
        if timestamp_ms > self.stream_time.get(topic, -1):
            self.stream_time[topic] = timestamp_ms

    def _closed(self, group_id: str) -> str | None:
        if group_id in self.published:
            return REPLAYED if self.published[group_id].from_ledger else LATE
        group = self.groups.get(group_id)
        if group is not None and group.status == IN_FLIGHT:
            return LATE
        return None

    def add_receipt(self, item: ReceiptItem, now_ms: int) -> str:
        """ADDED, DUPLICATE, LATE, REPLAYED or CONFLICT; after CONFLICT ``last_conflict`` says
        which field contradicts the group (the runtime forwards it to the dead letter)."""
        pos = item.position
        self._seen(pos.topic, pos.offset, pos.timestamp_ms)
        closed = self._closed(item.group_id)
        if closed:
            return self._count(closed, "receipt")
        conflict = self._conflict(item)
        if conflict:
            self.last_conflict = conflict
            return self._count(CONFLICT, "receipt")
        group = self._group_for(item.group_id, pos.timestamp_ms, now_ms)
        held = group.receipts.get(item.rollout_index)
        if held is not None:
            return self._duplicate(receipt_difference(held, item), "receipt")
        if group.fields is None:
            group.fields = GroupFields.of(item)
        group.receipts[item.rollout_index] = item
        group.result_fields.update(field for field, _sum, _count in item.result_stats)
        self._admit(group, item.nbytes, pos, now_ms)
        group.invalidate()
        self._check_complete(group)
        return self._count(ADDED, "receipt")

    def _conflict(self, item: ReceiptItem) -> str | None:
        if not (0 < item.group_size and 0 <= item.rollout_index < item.group_size):
            return (f"conflicts with group {item.group_id}: rollout_index {item.rollout_index} "
                    f"out of range for group_size {item.group_size}")
        group = self.groups.get(item.group_id)
        if group is None:
            return result_fields_text(set(), item)
        if group.fields is not None:
            text = conflict_text(group.fields, item)
            if text:
                return text
        return result_fields_text(group.result_fields, item)

    def add_staged(self, item: StagedItem, now_ms: int) -> str:
        pos = item.position
        self._seen(pos.topic, pos.offset, pos.timestamp_ms)
        closed = self._closed(item.group_id)
        if closed:
            return self._count(closed, "staged")
        group = self._group_for(item.group_id, pos.timestamp_ms, now_ms)
        held = group.staged.get(item.staging_key)
        if held is not None:
            return self._duplicate(staged_difference(held, item), "staged")
        ref = item.route_ref
        if ref is not None and (ref.topic != self.routes_topic or ref.partition != self.partition):
            item.route_ref = None   # chunks this partition never reads: nothing to wait for (the
            #                         rollout is rejected at finalization, naming where they are)
        group.staged[item.staging_key] = item
        self._admit(group, item.nbytes, pos, now_ms)
        if group._missing_keys is not None:
            group._missing_keys.discard(item.staging_key)
        if group._missing_chunks is not None:
            group._missing_chunks.update(key for key in item.route_keys() if key not in group.chunks)
        self._check_complete(group)
        return self._count(ADDED, "staged")

    def add_route_chunk(self, item: RouteChunkItem, now_ms: int) -> str:
        """A route chunk (direct router replay), held in its group under (staging_key, offset):
        ADDED, DUPLICATE (the same offset read twice), LATE or REPLAYED. Which of two records
        of one chunk is read is the reference's choice (by offset), at finalization."""
        pos = item.position
        self._seen(pos.topic, pos.offset, pos.timestamp_ms)
        closed = self._closed(item.group_id)
        if closed:
            return self._count(closed, "route_chunk")
        group = self._group_for(item.group_id, pos.timestamp_ms, now_ms)
        if item.key in group.chunks:
            return self._count(DUPLICATE, "route_chunk")
        group.chunks[item.key] = item
        self._admit(group, item.nbytes, pos, now_ms)
        if group._missing_chunks is not None:
            group._missing_chunks.discard(item.key)
        self._check_complete(group)
        return self._count(ADDED, "route_chunk")

    def _duplicate(self, difference: str | None, kind: str) -> str:
        """A second record under a held identity: DUPLICATE (same content), else CONFLICT
        with ``last_conflict`` naming what differs. The first copy stays either way."""
        if difference is None:
            return self._count(DUPLICATE, kind)
        self.last_conflict = difference
        return self._count(CONFLICT, kind)

    def _admit(self, group: GroupState, nbytes: int, pos, now_ms: int) -> None:
        group.nbytes += nbytes
        self.nbytes += nbytes
        # Only grows (spilling moves a record's bytes, it does not shrink its group): the
        # finalize reserve (stage.runtime.state.memory) is sized on the largest group seen.
        self.largest_group_bytes = max(self.largest_group_bytes, group.nbytes + group.spilled_bytes)
        group.note_position(pos.topic, pos.offset, pos.timestamp_ms)
        # The deadline counts from the earliest record, not the first one read: which topic
        # the consumer happens to read first (after a restart, too) must not move it later.
        # An earlier deadline is pushed; the stale later entry is skipped or fires no earlier.
        deadline = self._deadline_of(pos.timestamp_ms, now_ms)
        if deadline < group.deadline_ms:
            group.deadline_ms = deadline
            heapq.heappush(self._deadlines, (deadline, group.group_id))

    def _check_complete(self, group: GroupState) -> None:
        if group.status == OPEN and group.complete:
            self._complete.add(group.group_id)

    def _count(self, outcome: str, kind: str) -> str:
        self.counts[f"{kind}_{outcome}"] += 1
        return outcome

    # -- readiness -------------------------------------------------------------------------
    def deadline_actionable(self, deadline_ms: int, now_ms: int, read_to_end: dict | None,
                            force_before_ms: int | None = None) -> bool:
        """A deadline fires on the wall clock only once both input topics have been read past
        it: a record stamped at or after it was seen, or the partition was read to its end as
        of a moment at or after the deadline (``read_to_end``: topic -> that moment in ms, from
        the brokers). Otherwise a stage catching up after downtime, or one whose partition
        leader is failing over, would finalize groups before reading their records.
        ``force_before_ms``: deadlines at or before it fire regardless (the bounded wait for an
        unavailable partition)."""
        if now_ms < deadline_ms:
            return False
        if force_before_ms is not None and deadline_ms <= force_before_ms:
            return True
        if read_to_end is None:
            return True
        return all(read_to_end.get(topic, -1) >= deadline_ms or self.stream_time.get(topic, -1) >= deadline_ms
                   for topic in self.input_topics)

    @property
    def input_topics(self) -> tuple[str, ...]:
        if self.routes_topic is None:
            return (self.receipts_topic, self.staged_topic)
        return (self.receipts_topic, self.staged_topic, self.routes_topic)

    def take_ready(self, now_ms: int, read_to_end: dict | None = None, *,
                   force_before_ms: int | None = None
                   ) -> tuple[list[tuple[GroupState, str]], list[GroupState]]:
        """Groups to finalize now (complete first, then past deadline) and expired orphans
        (deadline passed with staged calls but no receipt: there is no N to publish).
        ``read_to_end``: see ``deadline_actionable`` (None: assume read to the end now)."""
        ready: list[tuple[GroupState, str]] = []
        for group_id in sorted(self._complete):
            group = self.groups[group_id]
            group.status = IN_FLIGHT
            ready.append((group, COMPLETE))
        self._complete.clear()
        orphans: list[GroupState] = []
        while self._deadlines and self.deadline_actionable(self._deadlines[0][0], now_ms, read_to_end,
                                                           force_before_ms):
            _, group_id = heapq.heappop(self._deadlines)
            group = self.groups.get(group_id)
            if group is None or group.status != OPEN:
                continue  # published or taken already: lazy deletion
            if group.receipts:
                group.status = IN_FLIGHT
                ready.append((group, DEADLINE))
            else:
                orphans.append(self._forget(group_id))
                self.counts["orphan_groups_expired"] += 1
                self.counts["orphan_staged_expired"] += len(group.staged)
                self.counts["orphan_route_chunks_expired"] += len(group.chunks)
        return ready, orphans

    def next_deadline_ms(self) -> int | None:
        while self._deadlines and (self._deadlines[0][1] not in self.groups
                                   or self.groups[self._deadlines[0][1]].status != OPEN):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    # -- publication -----------------------------------------------------------------------
    def mark_published(self, group_id: str, now_ms: int) -> int:
        """The group is published: forgotten, its id remembered. Returns how many of its route
        chunks no reference named (a producer's retry, an abandoned call): dropped with it."""
        group = self._forget(group_id)
        unreferenced = group.unreferenced_chunks() if group.chunks else 0
        self.counts["route_chunk_unreferenced"] += unreferenced
        self.published[group_id] = Published(dict(group.max_offsets), now_ms)
        return unreferenced

    def release(self, group_id: str) -> None:
        """Put an in-flight group back (its publication was aborted); it is retried."""
        group = self.groups[group_id]
        group.status = OPEN
        if group.complete:
            self._complete.add(group_id)
        else:
            heapq.heappush(self._deadlines, (group.deadline_ms, group_id))

    def _forget(self, group_id: str) -> GroupState:
        group = self.groups.pop(group_id)
        self.nbytes -= group.nbytes
        if group.spilled_bytes:
            self.spilled_bytes -= group.spilled_bytes
            for item in (*group.staged.values(), *group.chunks.values()):
                if item.spilled:
                    self.spill.release(item.payload)
        self._complete.discard(group_id)
        return group

    # -- spilling --------------------------------------------------------------------------
    def spill_staged(self, item: StagedItem, value: bytes, keep: int) -> bool:
        """Move an admitted staged call's record to disk: its ``value`` (the record's bytes)
        goes to the spill store, and the item keeps ``keep`` bytes in memory (its decoded
        small fields, and digests of the rest for the duplicate check: no bytes of the
        record). False when there is no store or it is full."""
        if self.spill is None or item.spilled:
            return False
        group = self.groups.get(item.group_id)
        if group is None or group.staged.get(item.staging_key) is not item:
            return False
        ref = self.spill.put(value)
        if ref is None:
            return False
        keep_digests(item)    # the duplicate check's view of it, without its bytes
        freed = max(0, item.nbytes - keep)
        item.payload, item.nbytes, item.spilled = ref, item.nbytes - freed, len(value)
        group.nbytes -= freed
        self.nbytes -= freed
        group.spilled_bytes += len(value)
        self.spilled_bytes += len(value)
        return True

    def spill_route_chunk(self, item: RouteChunkItem, value: bytes, keep: int) -> bool:
        """Move an admitted route chunk's record to disk, as ``spill_staged`` does a staged
        call's: it keeps ``keep`` bytes in memory (its ids). False when there is no store or it
        is full."""
        if self.spill is None or item.spilled:
            return False
        group = self.groups.get(item.group_id)
        if group is None or group.chunks.get(item.key) is not item:
            return False
        ref = self.spill.put(value)
        if ref is None:
            return False
        freed = max(0, item.nbytes - keep)
        item.payload, item.nbytes, item.spilled = ref, item.nbytes - freed, len(value)
        group.nbytes -= freed
        self.nbytes -= freed
        group.spilled_bytes += len(value)
        self.spilled_bytes += len(value)
        return True

    def close(self) -> None:
        """The partition leaves this process (revoked, lost, rewound): its spill goes."""
        if self.spill is not None:
            self.spill.close()

    def load_published(self, group_id: str, max_offsets: dict, published_at_ms: int) -> None:
        """A ledger entry read at assignment: records of this group will be skipped."""
        self.published[group_id] = Published(dict(max_offsets), published_at_ms, from_ledger=True)

    # -- offsets ---------------------------------------------------------------------------
    def committable(self, topic: str, committed: int | None = None, *, excluding=()) -> int | None:
        """The lowest offset an unpublished group still needs, else one past the last record
        seen; never below what is already committed. None if nothing was seen. ``excluding``:
        groups being published in the same transaction (they no longer hold the watermark)."""
        needed = [g.min_offsets[topic] for g in self.groups.values()
                  if topic in g.min_offsets and g.group_id not in excluding]
        candidate = min(needed) if needed else self.next_offsets.get(topic)
        if candidate is None:
            return committed
        return candidate if committed is None else max(candidate, committed)

    def expire_published(self, committed: dict[str, int], now_ms: int) -> list[str]:
        """Published groups whose every input record is below the committed offsets and whose
        late-record retention has passed: their ledger entries can be tombstoned."""
        out = []
        for group_id, info in self.published.items():
            if now_ms - info.published_at_ms < self.late_retention_ms:
                continue
            if all(offset < committed.get(topic, -1) for topic, offset in info.max_offsets.items()):
                out.append(group_id)
        for group_id in out:
            del self.published[group_id]
        return out

    @property
    def open_groups(self) -> int:
        return len(self.groups)
