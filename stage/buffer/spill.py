"""Staged records kept on local disk instead of in memory while the stage is over its cap.

The stage cannot pause its input when every buffered group waits for records it has not read
yet (it would wait for them forever), so when groups stay open long (agentic rollouts of many
calls, N=16 groups finishing over minutes) the buffer would grow past ``max_buffered_bytes``.
Instead, a staged call admitted while the stage holds its cap has its record bytes appended
to a spill segment on local disk and only its small decoded fields stay in memory; the group's
finalization reads the record back (stage.runtime.task.source). Nothing here needs to survive a
crash: Kafka holds the records, and a restarted stage re-reads them from the committed offsets.

Segments are append-only files of a partition's spill directory; one is deleted as soon as no
buffered record lives in it any more, and the whole directory when the partition is dropped.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 256 << 20


class SpillReadError(OSError):
    """A spilled record could not be read back: the local disk's fault, never the record's
    (stage.finalize.failures halts the partition on it instead of rejecting the rollout)."""


@dataclass(frozen=True)
class SpilledRecord:
    """Where a record's bytes lie on disk (picklable: a worker process reads them too)."""

    path: str
    offset: int
    length: int

    def read(self) -> bytes:
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                data = os.pread(fd, self.length, self.offset)
            finally:
                os.close(fd)
        except OSError as error:
            raise SpillReadError(f"spilled record {self.path}@{self.offset}: {error}") from error
        if len(data) != self.length:
            raise SpillReadError(f"spilled record {self.path}@{self.offset}: {len(data)} of "
                                 f"{self.length} bytes")
        return data


class _Segment:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.size = 0
        self.live = 0          # records of it still buffered

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class SpillStore:
    """One partition's spill segments; at most ``max_bytes`` of live records."""

    def __init__(self, directory: str | Path, *, max_bytes: int, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.live_bytes = 0
        self.failed: str | None = None     # why the disk refused a write, once it did
        self._segments: dict[str, _Segment] = {}
        self._active: _Segment | None = None
        self._count = 0

    def put(self, value: bytes) -> SpilledRecord | None:
        """Append ``value``; None when the store is full or its disk refuses (the record then
        stays in memory: spilling is an economy, never a reason to stop)."""
        if self.failed is not None or self.live_bytes + len(value) > self.max_bytes:
            return None
        segment = self._active
        try:
            if segment is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._count += 1
                segment = _Segment(self.directory / f"segment-{self._count:06d}")
                self._segments[str(segment.path)] = segment
                self._active = segment
            offset = segment.size
            view = memoryview(value)
            while view:
                written = os.write(segment.fd, view)
                view = view[written:]
        except OSError as error:   # no space, a read-only or missing directory: stop spilling
            self.failed = f"{type(error).__name__}: {error}"
            logger.warning("spilling to %s failed (%s); records stay in memory from now on",
                           self.directory, self.failed)
            if segment is not None and segment.live == 0:
                self._discard(segment)
            return None
        segment.size += len(value)
        segment.live += 1
        self.live_bytes += len(value)
        if segment.size >= self.segment_bytes:
            self._active = None
            segment.close()
        return SpilledRecord(str(segment.path), offset, len(value))

    def release(self, ref: SpilledRecord) -> None:
        """The record's group left the buffer: its bytes are no longer needed."""
        segment = self._segments.get(ref.path)
        if segment is None:
            return
        segment.live -= 1
        self.live_bytes -= ref.length
        if segment.live <= 0:     # nothing in it is buffered: its bytes are dead, the file goes
            self._discard(segment)

    def _discard(self, segment: _Segment) -> None:
        if segment is self._active:
            self._active = None
        segment.close()
        self._segments.pop(str(segment.path), None)
        try:
            os.unlink(segment.path)
        except OSError:
            pass

    @property
    def segments(self) -> int:
        return len(self._segments)

    def close(self) -> None:
        """Delete every segment (the partition was dropped or reloaded)."""
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()
        self._active = None
        self.live_bytes = 0
        shutil.rmtree(self.directory, ignore_errors=True)
