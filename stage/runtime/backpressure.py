"""The back-pressure step: pause every assigned partition while the buffers hold more than
their caps, resume once they drained below ``resume_fraction`` of them.

Owns: whether it holds the BACKPRESSURE pause now. Reads every partition's buffered bytes and
open groups; ``busy`` says whether any group is being finalized or published.
"""

from __future__ import annotations

from stage.runtime.pauses import BACKPRESSURE


class BackPressure:
    def __init__(self, cfg, *, partitions, pauses, stats, busy) -> None:
        self.max_bytes = cfg.max_buffered_bytes
        self.max_groups = cfg.max_buffered_groups
        self.resume_fraction = cfg.resume_fraction
        self.partitions = partitions
        self.pauses = pauses
        self.stats = stats
        self.busy = busy        # () -> True while groups are finalizing, queued or publishing
        self.paused = False

    def apply(self) -> None:
        nbytes = sum(s.buffered_bytes for s in self.partitions)
        groups = sum(s.open_groups for s in self.partitions)
        self.stats.set("buffered_bytes", nbytes)
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
