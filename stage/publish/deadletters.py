"""Dead letters: an input record the stage cannot use, published with its original bytes.

A dead letter carries the record's key and value untouched (a null value stays null), its
original headers, and headers naming where it came from and why: ``source-topic``,
``source-partition``, ``source-offset``, ``error`` (the precise reason) and ``error-class``
(``undecodable``, ``invalid``, ``misrouted`` or ``conflict``).

Exactly once: committed offsets stay at the oldest open group, so a restarted or rebalanced
stage re-reads records it has already dead-lettered. Each transaction that carries dead letters
of an input partition also writes that partition's *dead-letter watermark* to the ledger (the
highest input offsets dead-lettered so far, per input topic) under a reserved key that is not
valid UTF-8 and so can never be a group id. After a reload, a bad record at or below the
watermark is counted and skipped instead of being dead-lettered again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stage.wire.topics import INPUT_LEDGER_FIELDS

DEAD_LETTER_WATERMARK_KEY = b"\xffdead-letters"
MAX_ERROR_BYTES = 4000

UNDECODABLE = "undecodable"   # not Avro of the topic's schema (or an unknown schema id)
INVALID = "invalid"           # decodes, but a field is out of range or malformed
MISROUTED = "misrouted"       # key or partition contradicts the record's group_id
CONFLICT = "conflict"         # contradicts its group (group size, group-level fields)
ERROR_CLASSES = (UNDECODABLE, INVALID, MISROUTED, CONFLICT)
# records_skipped reason of a bad record at or below the watermark (dead-lettered already)
DEAD_LETTERED_BEFORE = "dead_lettered_before"


@dataclass(frozen=True)
class DeadLetter:
    """One rejected input record, with the source partition it must be accounted to."""

    source_topic: str
    source_partition: int
    source_offset: int
    key: bytes | None
    value: bytes | None
    headers: list
    error: str
    error_class: str
    # The source partition's dead-letter marks (input topic -> highest offset dead-lettered)
    # as of this record: the watermark the transaction carrying it writes to the ledger.
    marks: dict = field(default_factory=dict)
    epoch: int = 0          # the source partition's load epoch when it was rejected

    def record(self, dead_letter_topic: str) -> tuple:
        """(topic, partition, key, value, headers) for a publisher batch."""
        headers = list(self.headers or []) + [
            ("source-topic", self.source_topic.encode()),
            ("source-partition", str(self.source_partition).encode()),
            ("source-offset", str(self.source_offset).encode()),
            ("error", self.error.encode("utf-8", "replace")[:MAX_ERROR_BYTES]),
            ("error-class", self.error_class.encode())]
        return (dead_letter_topic, None, self.key, self.value, headers)


def watermark_entry(partition: int, offsets: dict[str, int], now_ms: int) -> dict:
    """The LedgerEntry value stored under DEAD_LETTER_WATERMARK_KEY: ``offsets`` is input role
    -> the highest offset dead-lettered (-1 if none). group_id is empty; outcome carries no
    meaning for this entry."""
    marks = {field: offsets.get(role, -1) for role, field in INPUT_LEDGER_FIELDS.items()}
    return {"group_id": "", "partition": partition, **marks, "outcome": "complete",
            "published_at_ms": now_ms, "output_digest": ""}