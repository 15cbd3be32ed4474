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

Every record is read back as it was written, or not at all: its CRC-32 is taken at write and
checked at read, and a mismatch (a flipped bit on the disk, a truncated or replaced file) is a
``SpillReadError``, the disk's fault, which halts the partition (stage.finalize.failures,
``spill``) so that the records are read again from Kafka; never a rejection of the input.
The spill directory is private: this replica's root is created 0700 at start and refused when
it is a link or another user's (``prepare_spill_root``); segments are created exclusively and
opened without following links.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 256 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class SpillReadError(OSError):
    """A spilled record could not be read back whole: the local disk's fault, never the
    record's (stage.finalize.failures halts the partition on it instead of rejecting the
    rollout)."""


class SpillDirError(OSError):
    """The spill directory is not this process's to use (a start-up configuration error)."""


@dataclass(frozen=True)
class SpilledRecord:
    """Where a record's bytes lie on disk and their CRC-32 (picklable: a worker process reads
    them too)."""

    path: str
    offset: int
    length: int
    crc32: int

    def read(self) -> bytes:
        try:
            fd = os.open(self.path, os.O_RDONLY | _NOFOLLOW)
            try:
                data = os.pread(fd, self.length, self.offset)
            finally:
                os.close(fd)
        except OSError as error:
            raise SpillReadError(f"spilled record {self.path}@{self.offset}: {error}") from error
        if len(data) != self.length:
            raise SpillReadError(f"spilled record {self.path}@{self.offset}: {len(data)} of "
                                 f"{self.length} bytes")
        if zlib.crc32(data) != self.crc32:
            raise SpillReadError(f"spilled record {self.path}@{self.offset}: checksum mismatch "
                                 f"(CRC-32 {zlib.crc32(data):08x}, written {self.crc32:08x}): "
                                 "its bytes changed on disk")
        return data


def prepare_spill_root(root: str | Path) -> Path:
    """Make ``root`` this process's private, empty spill directory: created with mode 0700
    (its parent, the configured ``spill_dir`` or the system's temporary directory, may be
    shared); one left by an earlier run of ours is emptied first. Raises SpillDirError when
    ``root`` is a link, not a directory, or another user's: it is never used, nor removed."""
    root = Path(root)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            _make_private(root)
            shutil.rmtree(root)          # what an earlier run of this replica left
        except FileNotFoundError:
            pass
        os.mkdir(root, 0o700)
        _make_private(root)
    except SpillDirError:
        raise
    except OSError as error:
        raise SpillDirError(f"spill directory {root}: {error}") from error
    return root


def _make_private(path: Path) -> None:
    """``path`` is a directory (not a link) this user owns: its mode set to 0700 (the umask
    or an earlier run may have left others bits). SpillDirError when it is not ours."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        info = os.lstat(path)
        why = "is a symbolic link" if stat.S_ISLNK(info.st_mode) else "is not a directory"
        raise _refused(path, why) from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode):
            raise _refused(path, "is not a directory")
        if info.st_uid != os.geteuid():
            raise _refused(path, f"belongs to uid {info.st_uid}, not to this process's uid {os.geteuid()}")
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _refused(path: Path, why: str) -> SpillDirError:
    return SpillDirError(
        f"spill directory {path} {why}: refusing to spill there (another user could read, "
        "change or redirect the spilled records); remove it, or set spill_dir to a directory "
        "this user owns")


class _Segment:
    def __init__(self, path: Path) -> None:
        self.path = path
        # Created here or not at all: never a file or link someone placed under this name.
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _NOFOLLOW, 0o600)
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
        self._made = False     # its directory was made (and checked) by this store

    def put(self, value: bytes) -> SpilledRecord | None:
        """Append ``value``; None when the store is full or its disk refuses (the record then
        stays in memory: spilling is an economy, never a reason to stop)."""
        if self.failed is not None or self.live_bytes + len(value) > self.max_bytes:
            return None
        segment = self._active
        try:
            if segment is None:
                self._make_directory()
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
        return SpilledRecord(str(segment.path), offset, len(value), zlib.crc32(value))

    def _make_directory(self) -> None:
        """This partition's directory, private (0700) and ours (an OSError stops spilling)."""
        if self._made:
            return
        try:
            self.directory.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
        _make_private(self.directory)
        self._made = True

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
        self._made = False
        shutil.rmtree(self.directory, ignore_errors=True)
