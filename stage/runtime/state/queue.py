"""A per-partition FIFO whose "oldest N" spans partitions (the order items were queued in).

Each step that holds work for partitions (groups waiting for a worker, finalized outputs, dead
letters, ledger tombstones) keeps one ``PartitionQueue``; ``forget(partitions)`` drops the share
of partitions that left or were reloaded."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class PartitionQueue(Generic[T]):
    def __init__(self) -> None:
        self._items: dict[int, list[tuple[int, T]]] = {}
        self._sequence = itertools.count(1)

    def put(self, partition: int, item: T, *, first: bool = False) -> None:
        """Queue ``item``; ``first``: ahead of everything queued (a retry)."""
        stamp = next(self._sequence)
        self._items.setdefault(partition, []).append((-stamp if first else stamp, item))

    def __len__(self) -> int:
        return sum(len(held) for held in self._items.values())

    def __bool__(self) -> bool:
        return any(self._items.values())

    def count(self, partition: int) -> int:
        return len(self._items.get(partition, ()))

    def items(self) -> list[T]:
        """Every item, oldest first (left in place)."""
        return [item for _stamp, item in self._ordered()]

    def of(self, partition: int) -> list[T]:
        return [item for _stamp, item in self._items.get(partition, ())]

    def peek_oldest(self) -> T | None:
        entries = self._ordered()
        return entries[0][1] if entries else None

    def take_oldest(self, limit: int | None = None) -> list[T]:
        """Remove and return the oldest ``limit`` items (all by default) across partitions."""
        entries = self._ordered()
        if limit is not None:
            entries = entries[:limit]
        taken = {stamp for stamp, _item in entries}
        for partition in list(self._items):
            kept = [entry for entry in self._items[partition] if entry[0] not in taken]
            if kept:
                self._items[partition] = kept
            else:
                del self._items[partition]
        return [item for _stamp, item in entries]

    def forget(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            self._items.pop(p, None)

    def _ordered(self) -> list[tuple[int, T]]:
        return sorted((entry for held in self._items.values() for entry in held), key=lambda e: e[0])
