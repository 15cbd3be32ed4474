"""The input topics as a table: one row per kind of input record.

Every place the runtime treats the inputs (subscribe and assign, decode, buffer, spill, the
ledger's offsets and dead-letter watermarks, committed offsets, the deadline probe) reads this
table, so a third input kind is one row here plus its topic setting, its Avro record and its
ledger field (stage.wire.topics.INPUT_LEDGER_FIELDS). ``lead`` is the subscribed topic: the group
assigns its partitions, and every other input's same partition is assigned alongside
(co-partitioning).

The table depends on the mode (``inputs(direct_routes)``, ``input_kinds(cfg)``): with direct
router replay (``finalize.direct_routes``) the route chunks a staged call references by
``routes_ref`` are a third input (``staged_routes``: RouteChunk records, buffered per group next
to the calls, spilled over the cap like them); in deferred mode, or with router replay off, the
stage never reads the route topic and the table is receipts and staged calls only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from stage.decode import DECODED_OVERHEAD_BYTES, receipt_item, staged_item
from stage.decode.route_chunks import SPILLED_CHUNK_BYTES, route_chunk_item
from stage.decode.staged import route_reference
from stage.wire import INPUT_LEDGER_FIELDS, TOPIC_RECORDS


def _receipt(record, position, nbytes, limits, keep_routes):
    return receipt_item(record, position, nbytes, limits)


def _staged(record, position, nbytes, limits, keep_routes):
    # Route payloads are held only where finalization reads them (direct router replay);
    # otherwise they are checked at decode and released (stage.decode.staged).
    item = staged_item(record, position, nbytes, limits, keep_routes=keep_routes)
    if keep_routes and record.get("routes_ref") is not None:
        # Direct router replay: the group waits for the chunks the reference names. A reference
        # that fails its checks names none; finalization rejects the rollout with the reason.
        try:
            item.route_ref = route_reference(record, limits, partition=position.partition)
        except ValueError:
            item.route_ref = None
    return item


def _route_chunk(record, position, nbytes, limits, keep_routes):
    return route_chunk_item(record, position, nbytes, limits)


def _add_receipt(buffer, item, now_ms):
    return buffer.add_receipt(item, now_ms)


def _add_staged(buffer, item, now_ms):
    return buffer.add_staged(item, now_ms)


def _add_route_chunk(buffer, item, now_ms):
    return buffer.add_route_chunk(item, now_ms)


def _spill_staged(buffer, item, value):
    # What a spilled staged call still holds in memory: its decoded small fields.
    return buffer.spill_staged(item, value, DECODED_OVERHEAD_BYTES)


def _spill_route_chunk(buffer, item, value):
    return buffer.spill_route_chunk(item, value, SPILLED_CHUNK_BYTES)


@dataclass(frozen=True)
class InputKind:
    role: str                 # its TopicNames field, and its key in the ledger's dead-letter marks
    lead: bool                # the subscribed topic (the others are assigned alongside it)
    item: Callable            # (record, Position, nbytes, InputLimits, keep_routes) -> buffer item
    add: Callable             # (PartitionBuffer, item, now_ms) -> the buffer's outcome
    # Admitted over the memory cap, its record goes to disk: (PartitionBuffer, item, value)
    # -> spilled; None: never spilled.
    spill: Callable | None = None

    @property
    def spills(self) -> bool:
        return self.spill is not None

    @property
    def record(self) -> str:
        """Its Avro record (stage.wire.topics.TOPIC_RECORDS)."""
        return TOPIC_RECORDS[self.role]

    @property
    def ledger_field(self) -> str:
        return INPUT_LEDGER_FIELDS[self.role]

    def topic(self, topics) -> str:
        return getattr(topics, self.role)


RECEIPTS = InputKind("receipts", lead=True, item=_receipt, add=_add_receipt)
STAGED_CALLS = InputKind("staged_calls", lead=False, item=_staged, add=_add_staged, spill=_spill_staged)
STAGED_ROUTES = InputKind("staged_routes", lead=False, item=_route_chunk, add=_add_route_chunk,
                          spill=_spill_route_chunk)

# The table of deferred router replay and of router replay off (the route topic never read).
INPUTS: tuple[InputKind, ...] = (RECEIPTS, STAGED_CALLS)
# The table of direct router replay: the route chunks are a third co-partitioned input.
DIRECT_INPUTS: tuple[InputKind, ...] = (RECEIPTS, STAGED_CALLS, STAGED_ROUTES)
LEAD = RECEIPTS


def inputs(direct_routes: bool = False) -> tuple[InputKind, ...]:
    """The table for a mode: ``direct_routes`` is ``finalize.direct_routes``."""
    return DIRECT_INPUTS if direct_routes else INPUTS


def input_kinds(cfg) -> tuple[InputKind, ...]:
    """The table for a StageConfig."""
    return inputs(cfg.finalize.direct_routes)


def input_topics(topics, kinds: tuple[InputKind, ...] = INPUTS) -> tuple[str, ...]:
    """The input topic names, in table order."""
    return tuple(kind.topic(topics) for kind in kinds)


def by_topic(topics, kinds: tuple[InputKind, ...] = INPUTS) -> dict[str, InputKind]:
    return {kind.topic(topics): kind for kind in kinds}


def alongside(topics, kinds: tuple[InputKind, ...] = INPUTS) -> tuple[str, ...]:
    """The input topics assigned by hand next to each lead partition."""
    return tuple(kind.topic(topics) for kind in kinds if not kind.lead)
