"""The back-pressure step: pause every assigned partition while the stage holds more than its
caps, resume once it drained below ``resume_fraction`` of them.

Bytes are everything the stage holds for unpublished groups (stage.runtime.state.memory:
buffered input, finalize working sets, outputs waiting, the transaction in flight); groups are
the open groups of the buffers. Owns: whether the BACKPRESSURE pause holds now (``paused``; the
pause reasons are derived from it, stage.runtime.state.pauses).
"""

from __future__ import annotations

from stage.runtime.state.memory import Holdings


class BackPressure:
    def __init__(self, cfg) -> None:
        self.max_bytes = cfg.max_buffered_bytes
        self.max_groups = cfg.max_buffered_groups
        self.resume_fraction = cfg.resume_fraction
        self.paused = False

    def apply(self, held: Holdings, open_groups: int, busy: bool) -> None:
        """``busy``: some group is being finalized, waits for a worker or is publishing."""
        nbytes = held.total
        full = nbytes >= self.max_bytes or open_groups >= self.max_groups
        drained = (nbytes < self.resume_fraction * self.max_bytes
                   and open_groups < self.resume_fraction * self.max_groups)
        # Never pause a buffer that can only progress with more input: when no group is being
        # finalized or published, every buffered group waits for records still unread, and a
        # paused consumer would wait for them forever (deadlines, too, wait until the input has
        # been read past them). The caps bound the buffer while groups complete.
        stuck = not busy
        if full and not stuck:
            self.paused = True
        elif self.paused and (drained or stuck):
            self.paused = False
