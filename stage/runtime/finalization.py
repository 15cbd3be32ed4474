"""The finalize step: groups taken as ready -> the worker pool -> finalized outputs queued on
their partition for the next transaction; a group that fails in a way that would fail every
group halts its partition.

Owns: the futures in the finalize pool (``inflight``, keyed by partition and group, each with
the epoch of the partition that took it: a result whose partition was dropped or reloaded since
is discarded), the groups they finalize, and their estimated working sets
(stage.runtime.memory). Touches, of a partition: its ``waiting`` and ``done`` queues and, on a
halt, ``halted``, its HALTED pause and its waiting groups. Uses: the workers (threads or
processes, stage.runtime.workers), the stats, and ``room`` (bytes left under
max_buffered_bytes): a group starts only when its working set fits, or when nothing else is in
progress. A group whose worker process died is handed back to its partition's queue once; a
second death halts the partition (a cause of the host's: memory, native code).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures.process import BrokenProcessPool

from stage.runtime.memory import group_working_set
from stage.runtime.pauses import HALTED

logger = logging.getLogger("stage.runtime.loop")


_ATTEMPTS = 2   # worker-process deaths a group may see before its partition halts


class Finalization:
    def __init__(self, *, workers, max_inflight: int, routes_mode: str, partitions, pauses, stats,
                 room=None, idle=None) -> None:
        self.workers = workers             # submit(group, why, epoch) -> Future[Outputs]
        self.max_inflight = max_inflight   # max_inflight_groups: finalizing + finalized, not published
        self.routes_mode = routes_mode     # off, deferred or direct: sizes the working set
        self.partitions = partitions
        self.pauses = pauses
        self.stats = stats
        self.room = room or (lambda: 1 << 62)   # () -> bytes left under the memory cap
        self.idle = idle or (lambda: True)       # () -> no transaction in flight
        self.inflight: dict[tuple[int, str], object] = {}
        self.working: dict[tuple[int, str], int] = {}   # estimated working set, same keys
        self.taken: dict[tuple[int, str], tuple] = {}   # (group, why, epoch), same keys
        self.attempts: dict[tuple[int, str], int] = {}  # worker deaths seen by a group

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
            need = group_working_set(group, self.routes_mode)
            alone = not self.inflight and not self.partitions.queued("done") and self.idle()
            if need > self.room() and not alone:
                return   # waits for publications to free memory
            self.partitions.take_oldest("waiting", 1)
            key = (group.partition, group.group_id)
            self.inflight[key] = self.workers.submit(group, why, epoch)
            self.working[key] = need
            self.taken[key] = (group, why, epoch)

    def collect(self) -> None:
        """Queue finished finalizations on their partitions (results of dropped or reloaded
        partitions are discarded)."""
        for key, future in list(self.inflight.items()):
            if future.done():
                del self.inflight[key]
                self.working.pop(key, None)
                taken = self.taken.pop(key)
                error = future.exception()   # finalize_and_encode never raises; a worker can die
                if error is not None:
                    self._worker_failed(key, taken, error)
                    continue
                self.attempts.pop(key, None)
                outputs = future.result()
                state = self.partitions.current(outputs.partition, outputs.epoch)
                if state is None:
                    continue
                if outputs.error is not None:
                    self._halt(state, outputs)
                    continue
                state.done.append((self.partitions.stamp(), outputs))
                self.stats.observe("finalize_seconds", outputs.finalize_s)

    def _worker_failed(self, key, taken, error: BaseException) -> None:
        """The worker running a group died (or its result could not come back). The pool is
        made anew; the group goes back to its partition's queue, or halts it after a second
        death (the same group killing its worker again is the host's problem: memory, native
        code, and would recur for every restart)."""
        group, why, epoch = taken
        if isinstance(error, BrokenProcessPool) and getattr(self.workers, "broken", False):
            logger.error("a finalize worker process died (%s); starting a new pool", error)
            self.workers.restart()
        state = self.partitions.current(group.partition, epoch)
        if state is None:
            return
        self.attempts[key] = self.attempts.get(key, 0) + 1
        if self.attempts[key] < _ATTEMPTS:
            logger.warning("group %s: its finalize worker failed (%s: %s); trying it again",
                           group.group_id, type(error).__name__, error)
            state.waiting.append((-self.partitions.stamp(), taken))   # ahead of every other
            return
        self.attempts.pop(key, None)
        self._halt(state, _Failed(group.partition, group.group_id,
                                  f"finalize_error: worker: {type(error).__name__}: {error} "
                                  f"({_ATTEMPTS} times: host memory or native code)"))

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


class _Failed:
    """What _halt needs of a group's outcome when no Outputs came back."""

    def __init__(self, partition: int, group_id: str, error: str) -> None:
        self.partition, self.group_id, self.error = partition, group_id, error
