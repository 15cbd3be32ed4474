"""Process-level allocator tuning applied by the command line (never on library import).

Verification allocates a few hundred KB of short-lived numpy arrays per rollout. With glibc's
defaults those come from fresh mmap()s (or a trimmed heap) and every 4 KiB page faults on first
touch: measured on the verify benchmark, ~0.65 ms of a 3.1 ms rollout. Raising the mmap and
trim thresholds keeps freed memory in the heap for reuse. Set
``ROLLOUT_REASSEMBLER_MALLOC_TUNING=0`` to keep the defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD = 128 << 20


def tune_malloc() -> bool:
    """Returns True when glibc accepted the settings."""
    if os.environ.get("ROLLOUT_REASSEMBLER_MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to tune
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok_mmap = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok_trim = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return ok_mmap and ok_trim
