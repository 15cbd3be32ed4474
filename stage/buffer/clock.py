"""Time sources. Deadlines compare record timestamps with wall-clock milliseconds; tests inject
a ManualClock so a deadline can fire with no traffic and no sleeping."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class ManualClock:
    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.t = start_ms

    def now_ms(self) -> int:
        return self.t

    def advance(self, ms: int) -> None:
        self.t += ms
