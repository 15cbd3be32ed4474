"""The finalize step: groups taken as ready -> the worker pool -> finalized outputs queued on
their partition for the next transaction; a group that fails in a way that would fail every
group halts its partition.

Owns: the futures in the finalize pool (``inflight``, keyed by partition and group, each with
the epoch of the partition that took it: a result whose partition was dropped or reloaded since
is discarded) and their estimated working sets (stage.runtime.memory). Touches, of a
partition: its ``waiting`` and ``done`` queues and, on a halt, ``halted``, its HALTED pause and
its waiting groups. Uses: the pool, the finalize settings, the codecs, the stats, and ``room``
(bytes left under max_buffered_bytes): a group starts only when its working set fits, or when
nothing else is in progress.
"""

from __future__ import annotations

import logging
import time

from stage.runtime.memory import working_set
from stage.runtime.pauses import HALTED
from stage.runtime.worker import finalize_and_encode

logger = logging.getLogger("stage.runtime.loop")


class Finalization:
    def __init__(self, *, pool, max_inflight: int, task, routes_mode: str, partitions, pauses, stats,
                 room=None, idle=None) -> None:
        self.pool = pool
        self.max_inflight = max_inflight   # max_inflight_groups: finalizing + finalized, not published
        self.task = task                   # keyword arguments of finalize_and_encode beyond the group
        self.routes_mode = routes_mode     # off, deferred or direct: sizes the working set
        self.partitions = partitions
        self.pauses = pauses
        self.stats = stats
        self.room = room or (lambda: 1 << 62)   # () -> bytes left under the memory cap
        self.idle = idle or (lambda: True)       # () -> no transaction in flight
        self.inflight: dict[tuple[int, str], object] = {}
        self.working: dict[tuple[int, str], int] = {}   # estimated working set, same keys

    @property
    def busy(self) -> bool:
        """Anything taken and not yet handed to a transaction."""
        return bool(self.inflight or self.partitions.queued("waiting") or self.partitions.queued("done"))

    @property
    def working_bytes(self) -> int:
        return sum(self.working.values())

    def submit(self) -> None:
        """Hand waiting groups to the pool, oldest first, while fewer than ``max_inflight``
        groups are finalizing or finalized but unpublished, and while their working sets fit
        under the memory cap (one group always may when nothing else is in progress)."""
        while (self.partitions.queued("waiting")
               and len(self.inflight) + self.partitions.queued("done") < self.max_inflight):
            [(group, why, epoch)] = self.partitions.peek_oldest("waiting")
            need = working_set(group.nbytes, self.routes_mode)
            alone = not self.inflight and not self.partitions.queued("done") and self.idle()
            if need > self.room() and not alone:
                return   # waits for publications to free memory
            self.partitions.take_oldest("waiting", 1)
            key = (group.partition, group.group_id)
            self.inflight[key] = self.pool.submit(finalize_and_encode, group, why, epoch, **self.task)
            self.working[key] = need

    def collect(self) -> None:
        """Queue finished finalizations on their partitions (results of dropped or reloaded
        partitions are discarded)."""
        for key, future in list(self.inflight.items()):
            if future.done():
                del self.inflight[key]
                self.working.pop(key, None)
                outputs = future.result()  # finalize_and_encode never raises
                state = self.partitions.current(outputs.partition, outputs.epoch)
                if state is None:
                    continue
                if outputs.error is not None:
                    self._halt(state, outputs)
                    continue
                state.done.append((self.partitions.stamp(), outputs))
                self.stats.observe("finalize_seconds", outputs.finalize_s)

    def drain(self, budget_s: float, only: set[int] | None = None) -> None:
        """Wait (bounded) for in-flight finalizations, optionally of some partitions only."""
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            pending = [k for k in self.inflight if only is None or k[0] in only]
            if not pending:
                break
            time.sleep(0.01)
            self.collect()
        self.collect()

    def _halt(self, state, out) -> None:
        """A group failed in finalization for a cause that fails every group (one of
        stage.finalize.failures.HALT_CAUSES: device, host memory, unpublishable): stop this
        partition here. The group stays unpublished and holds the committed offset, so a
        restart (after the cause is fixed) finalizes it again."""
        self.stats.inc("finalize_errors")
        if state.halted is None:
            state.halted = f"group {out.group_id}: {out.error}"
            logger.error("partition %d halted: group %s failed in finalization (%s). Nothing past it "
                         "is committed; fix the cause and restart the stage. Other partitions go on.",
                         out.partition, out.group_id, out.error)
        self.pauses.hold(out.partition, HALTED)
        state.waiting.clear()
        self.stats.set("halted_partitions", sum(1 for s in self.partitions if s.halted is not None))
