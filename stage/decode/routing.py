"""Is an input record where the contract says it must be? Key = its group_id (UTF-8), partition
= the contract's partitioner of that key (stage.wire.partitioner). A record that fails either
check would join the wrong group, or a group this member never sees complete, so it is
dead-lettered as ``misrouted: ...`` and never buffered."""

from __future__ import annotations

from stage.decode.errors import DecodeError
from stage.wire.partitioner import partition_for

MISROUTED = "misrouted"


class MisroutedError(DecodeError):
    """The record decoded, but its key or partition contradicts its group_id."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{MISROUTED}: {message}")


def check_routing(key: bytes | None, group_id: str, partition: int, partitions: int) -> None:
    expected = group_id.encode("utf-8")
    if key is None:
        raise MisroutedError(f"record has no key; the key must be the group_id {group_id!r} (UTF-8)")
    if key != expected:
        shown = key[:200].decode("utf-8", "backslashreplace")
        raise MisroutedError(f"key {shown!r} is not the record's group_id {group_id!r}; "
                             "key every record by its group_id")
    home = partition_for(key, partitions)
    if home != partition:
        raise MisroutedError(
            f"key {group_id!r} belongs in partition {home} of {partitions} (murmur2 of the key, "
            f"Kafka's Java default; librdkafka: partitioner=murmur2_random), found in partition "
            f"{partition}")
