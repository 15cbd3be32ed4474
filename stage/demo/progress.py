"""A small progress bar on stderr (redrawn in place on a terminal, a line per quarter otherwise)."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, total: int, *, stream=None, width: int = 30, enabled: bool = True,
                 min_interval: float = 0.1) -> None:
        self.total = max(0, total)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.enabled = enabled
        self.min_interval = min_interval
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.done = 0
        self.phase = ""
        self.note = ""
        self._drawn_at = 0.0
        self._quarter = -1
        self._width_used = 0

    def update(self, done: int | None = None, *, phase: str | None = None, note: str | None = None,
               force: bool = False) -> None:
        if done is not None:
            self.done = min(done, self.total) if self.total else done
        if phase is not None:
            if phase != self.phase and note is None:
                self.note = ""
            self.phase = phase
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if force or now - self._drawn_at >= self.min_interval:
                self._drawn_at = now
                line = self.render()
                pad = max(0, self._width_used - len(line))
                self._width_used = len(line)
                self.stream.write("\r" + line + " " * pad)
                self.stream.flush()
            return
        quarter = (4 * self.done // self.total) if self.total else 4
        if force or quarter != self._quarter:
            self._quarter = quarter
            self.stream.write(self.render() + "\n")
            self.stream.flush()

    def render(self) -> str:
        fraction = self.done / self.total if self.total else 1.0
        filled = int(round(fraction * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.monotonic() - self.started
        text = f"[{bar}] {self.done}/{self.total} groups {elapsed:5.1f}s"
        if self.phase:
            text += f"  {self.phase}"
        if self.note:
            text += f"  {self.note}"
        return text

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r" + self.render() + "\n")
            self.stream.flush()
