"""The trainer-side reader's checkpointable position.

A trainer saves ``reader.position()`` inside its own checkpoint and starts a new reader from it
after a crash, so that its train state and the input it consumed move together (the way Kafka
Connect sinks keep their offsets with the data they wrote). Per (topic, partition) the position
holds:

- ``offset``: every record below it belongs to a group that was handed out (or deliberately not
  handed out: skipped as stale, abandoned incomplete, unusable). It is the lowest offset of any
  group still being assembled or waiting to be handed out, else one past the last record read.
  ``None``: nothing read there yet (start from the beginning).
- ``handed_out``: the groups already handed out that have records at or above ``offset`` (a
  group's rows can straddle the offset when another group's rows interleave with them), each
  with the highest offset of its records there. A reader started from the position re-reads
  those records and drops them instead of handing the group out a second time or keeping a
  partial copy of it waiting forever. It also names the groups handed out within
  ``remember_records`` records below ``offset``, so that a copy of one published again after
  the offset (an at-least-once stage, a broker that shows aborted records) is dropped after a
  restart as it is within one run.

The position is plain data (``to_dict``: JSON-able, ``from_dict`` validates), so it fits any
checkpoint format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

TP = tuple[str, int]
FORMAT_VERSION = 1


@dataclass(frozen=True)
class PartitionPosition:
    topic: str
    partition: int
    offset: int | None                        # None: nothing read yet, start at the beginning
    handed_out: Mapping[str, int] = field(default_factory=dict)  # group -> highest offset here


@dataclass(frozen=True)
class ReadPosition:
    partitions: tuple[PartitionPosition, ...] = ()

    def offsets(self) -> dict[TP, int | None]:
        return {(p.topic, p.partition): p.offset for p in self.partitions}

    def handed_out(self) -> set[str]:
        return {group for p in self.partitions for group in p.handed_out}

    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "partitions": [
            {"topic": p.topic, "partition": p.partition, "offset": p.offset,
             "handed_out": dict(sorted(p.handed_out.items()))} for p in self.partitions]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ReadPosition":
        """The position ``to_dict`` wrote; ValueError naming what is wrong otherwise (a
        checkpoint file is input like any other)."""
        if not isinstance(data, Mapping) or data.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a reader position of format version {FORMAT_VERSION}: "
                             f"{str(data)[:200]}")
        entries = data.get("partitions")
        if not isinstance(entries, list):
            raise ValueError("reader position: 'partitions' must be a list")
        out, seen = [], set()
        for i, entry in enumerate(entries):
            where = f"reader position partitions[{i}]"
            if not isinstance(entry, Mapping):
                raise ValueError(f"{where}: expected a mapping")
            topic, partition, offset = entry.get("topic"), entry.get("partition"), entry.get("offset")
            handed = entry.get("handed_out", {})
            if not isinstance(topic, str) or not topic:
                raise ValueError(f"{where}.topic: expected a topic name, got {topic!r}")
            if not _count(partition):
                raise ValueError(f"{where}.partition: expected an integer >= 0, got {partition!r}")
            if offset is not None and not _count(offset):
                raise ValueError(f"{where}.offset: expected an integer >= 0 or null, got {offset!r}")
            if not isinstance(handed, Mapping) or not all(
                    isinstance(g, str) and _count(o) for g, o in handed.items()):
                raise ValueError(f"{where}.handed_out: expected group id -> offset, got "
                                 f"{str(handed)[:200]}")
            if (topic, partition) in seen:
                raise ValueError(f"{where}: {topic}[{partition}] appears twice")
            seen.add((topic, partition))
            out.append(PartitionPosition(topic, partition, offset, dict(handed)))
        return cls(tuple(out))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class PositionTracker:
    """Where the reader is, per (topic, partition): the next offset to read, and the offsets of
    every group that left assembly (``waiting``: complete but not handed out yet; ``finished``:
    handed out, skipped or abandoned). The assembler supplies the lowest offsets of the groups
    it still assembles. Finished groups are remembered until their records lie more than
    ``remember_records`` below the resume offset of every partition they were read from."""

    def __init__(self, remember_records: int = 2_000) -> None:
        self.remember_records = remember_records
        self.next: dict[TP, int | None] = {}
        self.waiting: dict[str, dict[TP, list[int]]] = {}    # group -> tp -> [low, high]
        self.finished: dict[str, dict[TP, list[int]]] = {}

    def assigned(self, tp: TP, offset: int | None) -> None:
        self.next.setdefault(tp, offset)

    def consumed(self, tp: TP, offset: int) -> None:
        self.next[tp] = offset + 1

    def wait(self, group_id: str, offsets: Mapping[TP, tuple[int, int]]) -> None:
        self.waiting[group_id] = {tp: list(span) for tp, span in offsets.items()}

    def finish(self, group_id: str, offsets: Mapping[TP, tuple[int, int]] | None = None) -> None:
        spans = self.waiting.pop(group_id, None)
        if spans is None:
            spans = {tp: list(span) for tp, span in (offsets or {}).items()}
        self.finished[group_id] = spans

    def extend(self, group_id: str, tp: TP, offset: int) -> None:
        """Another record of a group that already left assembly (a duplicate): a position must
        cover it too, or a restarted reader would start a partial copy of the group there."""
        spans = self.waiting.get(group_id) or self.finished.get(group_id)
        if spans is None:
            return
        span = spans.setdefault(tp, [offset, offset])
        span[0], span[1] = min(span[0], offset), max(span[1], offset)

    def forget(self, tps) -> None:
        """Partitions this reader no longer reads (revoked)."""
        gone = set(tps)
        for tp in gone:
            self.next.pop(tp, None)
        for groups in (self.waiting, self.finished):
            for group_id in [g for g, spans in groups.items() if gone & set(spans)]:
                del groups[group_id]

    def resume_offsets(self, assembling: Mapping[TP, int]) -> dict[TP, int | None]:
        out: dict[TP, int | None] = {}
        waiting_low: dict[TP, int] = {}
        for spans in self.waiting.values():
            for tp, (low, _) in spans.items():
                waiting_low[tp] = min(low, waiting_low.get(tp, low))
        for tp, nxt in self.next.items():
            candidates = [o for o in (nxt, assembling.get(tp), waiting_low.get(tp)) if o is not None]
            out[tp] = min(candidates) if candidates else None
        return out

    def position(self, assembling: Mapping[TP, int]) -> ReadPosition:
        resume = self.resume_offsets(assembling)
        self._prune(resume)
        handed: dict[TP, dict[str, int]] = {tp: {} for tp in resume}
        for group_id, spans in self.finished.items():
            for tp, (_, high) in spans.items():
                if resume.get(tp) is not None and high >= resume[tp] - self.remember_records:
                    handed[tp][group_id] = high
        return ReadPosition(tuple(PartitionPosition(t, p, resume[(t, p)], handed[(t, p)])
                                  for t, p in sorted(resume)))

    def prune(self, assembling: Mapping[TP, int]) -> None:
        self._prune(self.resume_offsets(assembling))

    def _prune(self, resume: Mapping[TP, int | None]) -> None:
        """Forget finished groups whose records all lie more than ``remember_records`` below
        the resume offset of their partition."""
        for group_id in [g for g, spans in self.finished.items() if all(
                resume.get(tp) is not None and high < resume[tp] - self.remember_records
                for tp, (_, high) in spans.items())]:
            del self.finished[group_id]

    def restore(self, position: ReadPosition) -> None:
        for p in position.partitions:
            tp = (p.topic, p.partition)
            self.next[tp] = p.offset
            for group_id, high in p.handed_out.items():
                self.finished.setdefault(group_id, {})[tp] = [high, high]
