"""Which finalization failures halt a partition: the one list (``HALT_CAUSES``).

A halt leaves the group unpublished and holds the partition's committed offset, so a restart
finalizes the same group again: right only for a cause that would fail every group the stage
finalizes, whatever their content (the device, the host, the stage itself). Publishing such
a group as placeholders and committing past it would lose group after group.

Everything else a group's input can make finalization raise is the input's, and never halts:
a rollout is rejected with a named reason (``stage.finalize.reasons``): the precise one where
the cause is known (nesting depth, non-finite values, route dims, record sizes), else
``finalize_error:<exception>`` for that rollout alone, else ``group_finalize_error:<exception>``
for every row of the group (exactly N placeholder rows are still published). docs/design.md,
"When a partition halts", is this table for operators; keep the two in step.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stage.buffer.spill import SpillReadError


@dataclass(frozen=True)
class HaltCause:
    name: str                                  # the `finalize_error` text starts with it
    why: str                                   # why it would fail every group
    action: str                                # what the operator does
    matches: Callable[[BaseException], bool]


_DEVICE_TEXT = re.compile(r"CUDA|cuda|CUBLAS|cuBLAS|cuDNN|CUDNN|NCCL|device-side assert|HIP error")
_HOST_MEMORY_TEXT = re.compile(r"DefaultCPUAllocator|can't allocate memory")
_ACCELERATOR_ERRORS = tuple(cls for cls in (getattr(torch, "AcceleratorError", None),
                                            getattr(torch.cuda, "OutOfMemoryError", None)) if cls)


def _device_failure(error: BaseException) -> bool:
    if isinstance(error, _ACCELERATOR_ERRORS):
        return True
    return isinstance(error, RuntimeError) and bool(_DEVICE_TEXT.search(str(error)[:2000]))


def _host_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    return isinstance(error, RuntimeError) and bool(_HOST_MEMORY_TEXT.search(str(error)[:2000]))


DEVICE = HaltCause(
    "device", "the finalize device failed (a CUDA error, device memory exhausted, a lost or "
    "reset device): every group needs it",
    "fix or free the device, or set finalize.device to cpu; restart the stage", _device_failure)
HOST_MEMORY = HaltCause(
    "host_memory", "the host ran out of memory while finalizing: the group is retried after a "
    "restart and needs the same memory (direct router replay shapes an [N, longest row, L, K] "
    "int16 group tensor)",
    "give the stage more memory, or lower max_buffered_bytes, max_inflight_groups or "
    "finalize_workers; restart", _host_memory)
SPILL = HaltCause(
    "spill", "a staged record spilled to local disk (stage.buffer.spill) could not be read back "
    "whole (a read error, or its CRC-32 no longer matches): the disk or its directory failed, "
    "not the record",
    "check spill_dir (space, permissions, the volume, its health); restart (the records are "
    "re-read from Kafka)", lambda error: isinstance(error, SpillReadError))
UNPUBLISHABLE = HaltCause(
    "unpublishable", "even N placeholder rows of the group could not be built or encoded: "
    "they depend only on ids and sizes the decoder bounds, so the stage itself is at fault "
    "(a bug, the output codec or the schema registry) and would fail the next group too",
    "read the logged traceback (`group ... could not be finalized`); fix the configuration or "
    "report the bug; restart",
    lambda error: False)   # never matched: the worker names it when its last resort fails

HALT_CAUSES = (DEVICE, HOST_MEMORY, SPILL, UNPUBLISHABLE)


def halt_cause(error: BaseException) -> HaltCause | None:
    """The halt cause ``error`` is, or None: then it is the input's (reject, never halt)."""
    return next((cause for cause in HALT_CAUSES if cause.matches(error)), None)
