"""Everything the stage holds about one assigned input partition, and the assigned set.

A *partition* here is a co-partitioned set of input topic-partitions (receipts p + staged calls
p, stage.runtime.state.inputs). ``PartitionState`` is created when p is assigned and dropped
when it is revoked or lost; a rewind reloads it in place under a new epoch. It holds only what
is p's identity and p's input position:

=====================  ==========================================================  ============
field                  what                                                        one writer
=====================  ==========================================================  ============
number                 the partition                                               (constructor)
epoch                  unique per (re)load; results are matched to it              steps.loads
load                   the ledger load in progress (None once loaded)              steps.loads
buffer                 the join buffer (None until the ledger has loaded)          steps.loads
dead_letter_marks      highest offset dead-lettered, per topic (its own ``mark``)  steps.loads
committed              topic -> the offset this process last committed            steps.publication
=====================  ==========================================================  ============

Work in progress lives with the step that owns it (groups waiting for a worker and halts in
steps.finalization; outputs, dead letters and tombstones in steps.publication; held deadlines
in steps.deadlines); a step's ``forget(partitions)`` drops a partition's share. A result is
matched back to a partition by epoch, so one of a dropped or reloaded partition is discarded.
tests/runtime/test_ownership.py checks the writers above.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

from stage.buffer import PartitionBuffer


class DeadLetterMarks:
    """The highest offset of each input topic already dead-lettered (from the ledger at load,
    then advanced by the intake): a record at or below its mark was dead-lettered before."""

    def __init__(self, marks: dict[str, int] | None = None) -> None:
        self._marks = dict(marks or {})

    def mark(self, topic: str, offset: int) -> bool:
        """Record that ``offset`` is dead-lettered now; False if it was before (or below)."""
        if offset <= self._marks.get(topic, -1):
            return False
        self._marks[topic] = offset
        return True

    def get(self, topic: str, default: int = -1) -> int:
        return self._marks.get(topic, default)

    def snapshot(self) -> dict[str, int]:
        return dict(self._marks)


@dataclass(eq=False)
class PartitionState:
    number: int
    epoch: int
    load: Future | None = None
    buffer: PartitionBuffer | None = None
    dead_letter_marks: DeadLetterMarks = field(default_factory=DeadLetterMarks)
    committed: dict[str, int] = field(default_factory=dict)

    @property
    def loading(self) -> bool:
        return self.load is not None

    @property
    def open_groups(self) -> int:
        return self.buffer.open_groups if self.buffer is not None else 0

    @property
    def buffered_bytes(self) -> int:
        """Input bytes its buffer holds (groups in flight too, until they are published)."""
        return self.buffer.nbytes if self.buffer is not None else 0

    @property
    def spilled_bytes(self) -> int:
        return self.buffer.spilled_bytes if self.buffer is not None else 0

    @property
    def largest_group_bytes(self) -> int:
        return self.buffer.largest_group_bytes if self.buffer is not None else 0

    def close(self) -> None:
        """Its buffer leaves (the partition is dropped or reloaded): delete what it spilled."""
        if self.buffer is not None:
            self.buffer.close()
        self.buffer = None


class Partitions:
    """The assigned partitions, by number: membership and epochs. Assignment (through the
    runtime) adds and drops; steps read."""

    def __init__(self) -> None:
        self._states: dict[int, PartitionState] = {}
        self._epochs = itertools.count(1)

    def add(self, number: int) -> PartitionState:
        state = PartitionState(number, self.next_epoch())
        self._states[number] = state
        return state

    def drop(self, numbers) -> list[PartitionState]:
        dropped = [self._states.pop(p) for p in sorted(numbers) if p in self._states]
        for state in dropped:
            state.close()
        return dropped

    def next_epoch(self) -> int:
        return next(self._epochs)

    def get(self, number: int) -> PartitionState | None:
        return self._states.get(number)

    def current(self, number: int, epoch: int) -> PartitionState | None:
        """The state a result taken at ``epoch`` belongs to, if it still does."""
        state = self._states.get(number)
        return state if state is not None and state.epoch == epoch else None

    def numbers(self) -> list[int]:
        return sorted(self._states)

    def __iter__(self):
        return iter([self._states[p] for p in sorted(self._states)])

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, number: int) -> bool:
        return number in self._states

    def loaded(self) -> list[PartitionState]:
        return [s for s in self if s.buffer is not None]
