"""The input topics as a table: one row per kind of input record.

Every place the runtime treats the inputs (subscribe and assign, decode, buffer, spill, the
ledger's offsets and dead-letter watermarks, committed offsets, the deadline probe) reads this
table, so a third input kind (route fragments, say) is one row here plus its topic setting, its
Avro record and its ledger field (stage.wire.topics.INPUT_LEDGER_FIELDS, which this table
follows). ``lead`` is the subscribed topic: the group assigns its partitions, and every other
input's same partition is assigned alongside (co-partitioning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from stage.decode import receipt_item, staged_item
from stage.wire import INPUT_LEDGER_FIELDS, TOPIC_RECORDS


def _receipt(record, position, nbytes, limits, keep_routes):
    return receipt_item(record, position, nbytes, limits)


def _staged(record, position, nbytes, limits, keep_routes):
    # Route payloads are held only where finalization reads them (direct router replay);
    # otherwise they are checked at decode and released (stage.decode.staged).
    return staged_item(record, position, nbytes, limits, keep_routes=keep_routes)


def _add_receipt(buffer, item, now_ms):
    return buffer.add_receipt(item, now_ms)


def _add_staged(buffer, item, now_ms):
    return buffer.add_staged(item, now_ms)


@dataclass(frozen=True)
class InputKind:
    role: str                 # its TopicNames field, and its key in the ledger's dead-letter marks
    lead: bool                # the subscribed topic (the others are assigned alongside it)
    spills: bool              # admitted over the memory cap, its record goes to disk
    item: Callable            # (record, Position, nbytes, InputLimits, keep_routes) -> buffer item
    add: Callable             # (PartitionBuffer, item, now_ms) -> the buffer's outcome

    @property
    def record(self) -> str:
        """Its Avro record (stage.wire.topics.TOPIC_RECORDS)."""
        return TOPIC_RECORDS[self.role]

    @property
    def ledger_field(self) -> str:
        return INPUT_LEDGER_FIELDS[self.role]

    def topic(self, topics) -> str:
        return getattr(topics, self.role)


INPUTS: tuple[InputKind, ...] = (
    InputKind("receipts", lead=True, spills=False, item=_receipt, add=_add_receipt),
    InputKind("staged_calls", lead=False, spills=True, item=_staged, add=_add_staged),
)
LEAD = next(kind for kind in INPUTS if kind.lead)


def input_topics(topics) -> tuple[str, ...]:
    """The input topic names, in table order."""
    return tuple(kind.topic(topics) for kind in INPUTS)


def by_topic(topics) -> dict[str, InputKind]:
    return {kind.topic(topics): kind for kind in INPUTS}


def alongside(topics) -> tuple[str, ...]:
    """The input topics assigned by hand next to each lead partition."""
    return tuple(kind.topic(topics) for kind in INPUTS if not kind.lead)
