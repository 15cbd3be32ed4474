"""Process-level allocator tuning applied by the command line (never on library import).

Verification allocates a few hundred KB of short-lived numpy arrays per rollout. With glibc's
defaults those come from fresh mmap()s (or a trimmed heap) and every 4 KiB page faults on first
touch: measured on the verify benchmark, ~0.65 ms of a 3.1 ms rollout. Raising the mmap and
trim thresholds keeps freed memory in the heap for reuse. The price is memory the process
keeps once traffic stops: measured after a burst of 60 groups (8 x 4 calls, 48x8 routes), an
idle stage held ~500 MB of freed heap (1,310 MB RSS; 806 MB after ``malloc_trim``; glibc's
defaults keep as much). So ``run`` also starts an ``IdleTrimmer``: once the stage has done
nothing for a while it hands the free heap back to the OS, and never while records flow. Set
``ROLLOUT_REASSEMBLER_MALLOC_TUNING=0`` to keep glibc's defaults (no thresholds, no trim).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD = 128 << 20


logger = logging.getLogger(__name__)


def _enabled() -> bool:
    return os.environ.get("ROLLOUT_REASSEMBLER_MALLOC_TUNING", "1") != "0"


def _glibc_function(symbol: str):
    """A glibc function, or None (not glibc: musl, macOS; or no C library found)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return getattr(ctypes.CDLL(name), symbol)
    except (OSError, AttributeError):
        return None


def tune_malloc() -> bool:
    """Returns True when glibc accepted the settings."""
    if not _enabled():
        return False
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False  # not glibc: nothing to tune
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok_mmap = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok_trim = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return ok_mmap and ok_trim


def malloc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)`` (free heap of every arena back to the OS), or None."""
    trim = _glibc_function("malloc_trim")
    if trim is None:
        return None
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return lambda: trim(0)


class IdleTrimmer:
    """Calls ``trim`` once ``activity()`` (a number that moves whenever the process does work,
    e.g. the sum of the stage's counters) has not moved for ``idle_s`` seconds, then not again
    until it has moved. A daemon thread looks every ``interval_s`` seconds; ``check`` is the
    decision, callable without the thread."""

    def __init__(self, activity: Callable[[], float], trim: Callable[[], int], *, idle_s: float = 10.0,
                 interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.activity, self.trim, self.idle_s, self.interval_s, self.clock = activity, trim, idle_s, interval_s, clock
        self._last = activity()
        self._changed_at = clock()
        self._trimmed = False
        self.trims = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="malloc-idle-trim", daemon=True)

    def check(self) -> bool:
        """Trim if idle long enough and not trimmed since the last activity; True if it did."""
        now, value = self.clock(), self.activity()
        if value != self._last:
            self._last, self._changed_at, self._trimmed = value, now, False
            return False
        if self._trimmed or now - self._changed_at < self.idle_s:
            return False
        self.trim()
        self._trimmed = True
        self.trims += 1
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - memory housekeeping must never stop the stage
                logger.exception("idle heap trim failed")

    def start(self) -> "IdleTrimmer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


def idle_trimmer(activity: Callable[[], float]) -> IdleTrimmer | None:
    """A started IdleTrimmer for ``run``, or None (tuning off, or not glibc)."""
    trim = malloc_trim() if _enabled() else None
    return None if trim is None else IdleTrimmer(activity, trim).start()
