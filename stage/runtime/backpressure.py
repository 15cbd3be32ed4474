"""The back-pressure step: pause every assigned partition while the stage holds more than its
caps, resume once it drained below ``resume_fraction`` of them.

Bytes are everything the stage holds for unpublished groups (stage.runtime.memory: buffered
input, finalize working sets, outputs waiting, the transaction in flight); groups are the open
groups of the buffers. Owns: whether it holds the BACKPRESSURE pause now. ``holdings`` says
what is held where; ``busy`` whether any group is being finalized or published.
"""

from __future__ import annotations

from stage.runtime.pauses import BACKPRESSURE


class BackPressure:
    def __init__(self, cfg, *, partitions, pauses, stats, busy, holdings) -> None:
        self.max_bytes = cfg.max_buffered_bytes
        self.max_groups = cfg.max_buffered_groups
        self.resume_fraction = cfg.resume_fraction
        self.partitions = partitions
        self.pauses = pauses
        self.stats = stats
        self.busy = busy        # () -> True while groups are finalizing, queued or publishing
        self.holdings = holdings   # () -> stage.runtime.memory.Holdings
        self.paused = False

    def apply(self) -> None:
        held = self.holdings()
        nbytes = held.total
        groups = sum(s.open_groups for s in self.partitions)
        self.stats.set("buffered_bytes", held.buffered)
        self.stats.set("held_bytes", nbytes)
        self.stats.set("spilled_bytes", held.spilled)
        self.stats.set("open_groups", groups)
        full = nbytes >= self.max_bytes or groups >= self.max_groups
        drained = (nbytes < self.resume_fraction * self.max_bytes
                   and groups < self.resume_fraction * self.max_groups)
        # Never pause a buffer that can only progress with more input: when no group is being
        # finalized or published, every buffered group waits for records still unread, and a
        # paused consumer would wait for them forever (deadlines, too, wait until the input has
        # been read past them). The caps bound the buffer while groups complete.
        stuck = not self.busy()
        if full and not stuck and not self.paused:
            for p in self.partitions.numbers():
                self.pauses.hold(p, BACKPRESSURE)
            self.paused = True
        elif self.paused and (drained or stuck):
            self.pauses.release_everywhere(BACKPRESSURE)
            self.paused = False
