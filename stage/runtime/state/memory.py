"""What the stage holds in memory, by where it is, against ``max_buffered_bytes``.

A group's bytes are held in turn by: the buffer (its input records, until it is published),
the finalize step (the working set while it is finalized: decoded columns, route tensors, the
rows being encoded), its partition's ``done`` queue (its encoded outputs), and the transaction
in flight (the batch's records, and librdkafka's copy of them in the producer queue until the
transaction completes). Back-pressure pauses the input on the sum; the finalize step starts a
group only when the sum leaves room for its working set (or nothing else is in progress, so
that one group larger than the cap still moves). When the input cannot be paused (every buffered
group waits for records not read yet), staged records admitted while the sum is at the cap are
spilled to local disk (stage.buffer.spill) and read back when their group is finalized.

The intake spills before the cap: it keeps a *finalize reserve* free, the working set of the
largest group its partitions have held, so that when that group (or one like it) completes
while the buffer is full, finalizing it stays under the cap instead of adding its whole working
set on top (measured: docs/performance.md, direct router replay memory).
"""

from __future__ import annotations

from dataclasses import dataclass

# Working set of a group being finalized, as a multiple of its input bytes (beyond the input
# itself, which the buffer still counts): decoded token columns and the rows built from them,
# and in direct router replay the decoded routes, the group route tensor and the encoded rows
# that carry them.
# Direct: measured on issue 26's workload (98 MB groups of int16 48x8 routes, docs/performance.md):
# finalizing one held ~450 MiB beyond the buffer with its input read back from the spill, i.e.
# ~3.5x its input on top of the input itself; the estimate was 2x before that measurement.
WORKING_SET = {"direct": 3.5, "deferred": 1.0, "off": 1.0}
# librdkafka copies every produced value into its queue: the batch is held twice until the
# transaction completes.
PRODUCER_COPIES = 2


@dataclass
class Holdings:
    buffered: int = 0        # input records in the buffers (groups in flight included)
    finalizing: int = 0      # estimated working set of groups in the finalize pool
    outputs: int = 0         # encoded outputs waiting for a transaction
    publishing: int = 0      # the transaction in flight, with the producer's copy
    spilled: int = 0         # staged records on local disk (not memory: not in the total)

    @property
    def total(self) -> int:
        return self.buffered + self.finalizing + self.outputs + self.publishing


def working_set(group_bytes: int, routes_mode: str) -> int:
    return int(group_bytes * WORKING_SET.get(routes_mode, 1.0))


def group_working_set(group, routes_mode: str) -> int:
    """What finalizing ``group`` adds: its working set, plus its spilled records, read back."""
    return working_set(group.nbytes, routes_mode) + int(getattr(group, "spilled_bytes", 0) * (
        1 + WORKING_SET.get(routes_mode, 1.0)))


def finalize_reserve(largest_group_bytes: int, routes_mode: str, cap: int) -> int:
    """Room the intake leaves under ``cap`` (it spills instead of using it): what finalizing a
    group of ``largest_group_bytes`` input takes when all of it was spilled (read back, plus its
    working set), at most the whole cap (a group that large spills everything it can)."""
    return min(cap, int(largest_group_bytes * (1 + WORKING_SET.get(routes_mode, 1.0))))
