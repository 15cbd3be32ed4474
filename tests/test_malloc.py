"""The allocator tuning keeps freed heap for reuse while the stage works; the idle trimmer hands
it back to the OS once the stage has been idle, and never while it is busy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stage.runtime.malloc import IdleTrimmer, malloc_trim

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trims_once_per_idle_period_and_never_while_busy():
    clock, work, trims = Clock(), [0], []
    trimmer = IdleTrimmer(lambda: work[0], lambda: trims.append(clock.now), idle_s=10, clock=clock)
    for t in range(0, 30, 2):          # busy: the activity moves at every look
        clock.now, work[0] = float(t), work[0] + 1
        assert not trimmer.check()
    clock.now = 37.0                    # 9 s since the last activity (at 28)
    assert not trimmer.check()
    clock.now = 38.0                    # 10 s: trim
    assert trimmer.check() and trims == [38.0]
    clock.now = 100.0                   # still idle: once is enough
    assert not trimmer.check()
    work[0] += 1                        # a burst, then idle again: trim again
    assert not trimmer.check()
    clock.now = 110.0
    assert trimmer.check() and trims == [38.0, 110.0] and trimmer.trims == 2


_FRAGMENTED_HEAP = """
import re, numpy as np
from stage.runtime.malloc import IdleTrimmer, malloc_trim, tune_malloc
assert tune_malloc()
def rss_mb():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024
chunks = [np.ones(1 << 17) for _ in range(400)]      # 400 x 1 MiB from the heap (below the mmap threshold)
keep = chunks[-1]                                    # the topmost stays: the heap cannot just shrink
del chunks
before = rss_mb()
trimmer = IdleTrimmer(lambda: 0, malloc_trim(), idle_s=0)
assert trimmer.check()
print(before, rss_mb())
"""


@pytest.mark.skipif(malloc_trim() is None, reason="not glibc")
def test_the_trim_returns_freed_heap_to_the_os():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    before, after = map(int, proc.stdout.split())
    print(f"RSS with 400 MiB freed but kept by the tuned heap: {before} MB; after the idle trim: {after} MB")
    assert before - after > 300          # the freed MiB went back; the tuning alone keeps them
