"""Joining receipts with their staged calls per partition: state, deadlines and offsets.

No Kafka imports; the runtime feeds it decoded records and a clock.
"""

from stage.buffer.clock import Clock, ManualClock, SystemClock
from stage.buffer.fields import MAX_GROUP_RESULT_FIELDS, GroupFields
from stage.buffer.group import IN_FLIGHT, OPEN, GroupState
from stage.buffer.items import Position, ReceiptItem, StagedItem
from stage.buffer.partition import (
    ADDED,
    COMPLETE,
    CONFLICT,
    DEADLINE,
    DUPLICATE,
    LATE,
    REPLAYED,
    PartitionBuffer,
    Published,
)

__all__ = [
    "ADDED", "COMPLETE", "CONFLICT", "DEADLINE", "DUPLICATE", "IN_FLIGHT", "LATE",
    "MAX_GROUP_RESULT_FIELDS", "OPEN", "REPLAYED", "Clock", "GroupFields", "GroupState",
    "ManualClock", "PartitionBuffer", "Position", "Published", "ReceiptItem", "StagedItem", "SystemClock",
]
