"""Everything the stage holds for one assigned input partition, in one object.

A *partition* here is a co-partitioned pair: receipts p + staged calls p. ``PartitionState`` is
created when p is assigned and dropped, whole, when it is revoked or lost; a rewind reloads it
in place. Nothing about p lives anywhere else except in the consumer-level services, which
forget p through one call when it is dropped (``Partitions.drop``): the pause flags applied in
the consumer, the end-offset probe, the start offsets and the schema resolver's pending lookups.
The finalize pool's in-flight futures and the transaction in flight are the runtime's; their
results are matched back to a partition by its epoch, so a result of a dropped or reloaded
partition is recognised and discarded.

Queued work (groups waiting for a worker, finalized outputs, dead letters, ledger tombstones) is
stamped with one runtime-wide sequence number so that a step taking "the oldest N" across
partitions takes them in the order they were queued.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

from stage.buffer import PartitionBuffer


def output_bytes(out) -> int:
    """The encoded records of one finalized group (stage.runtime.worker.Outputs)."""
    return sum(len(value) for _topic, value in out.records if value) + len(out.ledger_value or b"")


@dataclass(eq=False)
class PartitionState:
    number: int
    epoch: int                                  # unique per (re)load: matches results to it
    buffer: PartitionBuffer | None = None       # None until its ledger is loaded
    load: Future | None = None                  # the ledger load in progress
    dead_letter_marks: dict[str, int] = field(default_factory=dict)  # topic -> highest offset dead-lettered
    committed: dict[str, int] = field(default_factory=dict)          # topic -> committed offset
    halted: str | None = None                   # why finalization stopped here
    held: str | None = None                     # why its due deadlines wait
    paused_for: set[str] = field(default_factory=set)   # reasons it is not fetched (stage.runtime.pauses)
    offsets_moved: bool = False                 # records consumed that no publication covered yet
    # Queues, each of (sequence, item): taken groups not yet submitted (group, why, epoch),
    # finalized Outputs, DeadLetters and ledger tombstones for the next transaction.
    waiting: list = field(default_factory=list)
    done: list = field(default_factory=list)
    dead_letters: list = field(default_factory=list)
    tombstones: list = field(default_factory=list)

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
    def output_bytes(self) -> int:
        """Encoded output bytes of its finalized groups waiting for a transaction."""
        return sum(output_bytes(out) for _seq, out in self.done)

    @property
    def spilled_bytes(self) -> int:
        return self.buffer.spilled_bytes if self.buffer is not None else 0

    def release_buffer(self) -> None:
        """Its buffer leaves (the partition is dropped or reloaded): delete what it spilled."""
        if self.buffer is not None:
            self.buffer.close()
        self.buffer = None

    def clear_queues(self) -> None:
        self.waiting.clear()
        self.done.clear()
        self.dead_letters.clear()
        self.tombstones.clear()


class Partitions:
    """The assigned partitions, by number. Steps reach a partition's state only through here."""

    def __init__(self) -> None:
        self._states: dict[int, PartitionState] = {}
        self._epochs = itertools.count(1)
        self._sequence = itertools.count()
        self._forgetters: list = []

    # -- membership ------------------------------------------------------------------------
    def on_drop(self, forget) -> None:
        """Register ``forget(partitions)`` of a consumer-level service keyed by partition."""
        self._forgetters.append(forget)

    def add(self, number: int) -> PartitionState:
        state = PartitionState(number, self.next_epoch())
        self._states[number] = state
        return state

    def drop(self, numbers) -> list[PartitionState]:
        dropped = [self._states.pop(p) for p in sorted(numbers) if p in self._states]
        for state in dropped:
            state.release_buffer()
        for forget in self._forgetters:
            forget(set(numbers))
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

    def loaded(self) -> list[PartitionState]:
        return [s for s in self if s.buffer is not None]

    # -- queues across partitions ----------------------------------------------------------
    def stamp(self) -> int:
        return next(self._sequence)

    def queued(self, queue: str) -> int:
        return sum(len(getattr(s, queue)) for s in self._states.values())

    def take_oldest(self, queue: str, limit: int | None = None) -> list:
        """Remove and return the oldest ``limit`` items (all by default) of one queue across
        every partition, in the order they were queued."""
        entries = sorted(((entry, state) for state in self._states.values()
                          for entry in getattr(state, queue)), key=lambda e: e[0][0])
        if limit is not None:
            entries = entries[:limit]
        taken: dict[int, set[int]] = {}
        for entry, state in entries:
            taken.setdefault(state.number, set()).add(id(entry))
        for number, ids in taken.items():
            held = getattr(self._states[number], queue)
            held[:] = [entry for entry in held if id(entry) not in ids]
        return [entry[1] for entry, _state in entries]

    def peek_oldest(self, queue: str) -> list:
        """The oldest item of one queue across partitions, left in place ([] if empty)."""
        entries = [entry for s in self._states.values() for entry in getattr(s, queue)]
        return [min(entries, key=lambda e: e[0])[1]] if entries else []

    def items(self, queue: str):
        """Every item of one queue across partitions (left in place)."""
        return [item for state in self._states.values() for _seq, item in getattr(state, queue)]
