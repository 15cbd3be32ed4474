"""The finalize step: groups taken as ready -> the worker pool -> finalized outputs handed on to
the publication step; a group that fails in a way that would fail every group halts its
partition.

Owns: the groups waiting for a worker (``waiting``, offered by the deadline step), the futures
in the finalize pool (``inflight``, keyed by partition and group, each with the epoch of the
partition that took it: a result whose partition was dropped or reloaded since is discarded),
their estimated working sets (stage.runtime.state.memory), and the halted partitions
(``halted``: partition -> why; the HALTED pause and the halted_partitions gauge are read from
it). Hands on: the finalized ``Outputs`` (``poll`` and ``drain`` return them). Uses: the
workers (threads or processes, stage.runtime.task.pools), the stats, and the budget: a group
starts only when its working set fits in the budget's room, or when nothing else is in
progress. A group whose worker process died is handed back to the queue once; a second death
halts the partition (a cause of the host's: memory, native code).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures.process import BrokenProcessPool

from stage.runtime.state.memory import group_working_set
from stage.runtime.state.queue import PartitionQueue
from stage.runtime.steps.deadlines import Ready
from stage.runtime.steps.outcomes import Budget

logger = logging.getLogger("stage.runtime.loop")


_ATTEMPTS = 2   # worker-process deaths a group may see before its partition halts


class Finalization:
    def __init__(self, *, workers, max_inflight: int, routes_mode: str, partitions, stats) -> None:
        self.workers = workers             # submit(group, why, epoch) -> Future[Outputs]
        self.max_inflight = max_inflight   # max_inflight_groups: finalizing + finalized, not published
        self.routes_mode = routes_mode     # off, deferred or direct: sizes the working set
        self.partitions = partitions       # read: is a result's partition still the one that took it
        self.stats = stats
        self.waiting: PartitionQueue[Ready] = PartitionQueue()
        self.inflight: dict[tuple[int, str], object] = {}
        self.working: dict[tuple[int, str], int] = {}   # estimated working set, same keys
        self.taken: dict[tuple[int, str], Ready] = {}   # same keys
        self.attempts: dict[tuple[int, str], int] = {}  # worker deaths seen by a group
        self.halted: dict[int, str] = {}                # partition -> why finalization stopped there

    @property
    def busy(self) -> bool:
        """Any group taken and not yet finalized."""
        return bool(self.inflight or self.waiting)

    @property
    def working_bytes(self) -> int:
        return sum(self.working.values())

    def offer(self, ready: list[Ready]) -> None:
        for work in ready:
            if work.group.partition not in self.halted:
                self.waiting.put(work.group.partition, work)

    def forget(self, partitions) -> None:
        """The partitions left or are reloaded: their waiting groups and halts go (results of
        their groups in flight are discarded by epoch when they come back)."""
        partitions = set(partitions)
        self.waiting.forget(partitions)
        for p in partitions:
            self.halted.pop(p, None)

    def submit(self, budget: Budget, queued_outputs: int = 0) -> None:
        """Hand waiting groups to the pool, oldest first, while fewer than ``max_inflight``
        groups are finalizing or finalized but unpublished (``queued_outputs``: finalized,
        waiting for a transaction), and while their working sets fit in the budget's room
        (one group always may when nothing else is in progress)."""
        room = budget.room
        while self.waiting and len(self.inflight) + queued_outputs < self.max_inflight:
            work = self.waiting.peek_oldest()
            need = group_working_set(work.group, self.routes_mode)
            alone = not self.inflight and not queued_outputs and budget.idle
            if need > room and not alone:
                return   # waits for publications to free memory
            self.waiting.take_oldest(1)
            key = (work.group.partition, work.group.group_id)
            self.inflight[key] = self.workers.submit(work.group, work.why, work.epoch)
            self.working[key] = need
            self.taken[key] = work
            room -= need

    def poll(self) -> list:
        """The finalizations that finished, as Outputs for the publication step (results of
        dropped or reloaded partitions are discarded; a failure that fails every group halts
        its partition instead)."""
        finished = []
        for key, future in list(self.inflight.items()):
            if not future.done():
                continue
            del self.inflight[key]
            self.working.pop(key, None)
            work = self.taken.pop(key)
            error = future.exception()   # finalize_and_encode never raises; a worker can die
            if error is not None:
                self._worker_failed(key, work, error)
                continue
            self.attempts.pop(key, None)
            outputs = future.result()
            if self.partitions.current(outputs.partition, outputs.epoch) is None:
                continue
            if outputs.error is not None:
                self._halt(outputs)
                continue
            finished.append(outputs)
            self.stats.observe("finalize_seconds", outputs.finalize_s)
        return finished

    def _worker_failed(self, key, work: Ready, error: BaseException) -> None:
        """The worker running a group died (or its result could not come back). The pool is
        made anew; the group goes back to the queue, or halts its partition after a second
        death (the same group killing its worker again is the host's problem: memory, native
        code, and would recur for every restart)."""
        group = work.group
        if isinstance(error, BrokenProcessPool) and getattr(self.workers, "broken", False):
            logger.error("a finalize worker process died (%s); starting a new pool", error)
            self.workers.restart()
        if self.partitions.current(group.partition, work.epoch) is None:
            return
        self.attempts[key] = self.attempts.get(key, 0) + 1
        if self.attempts[key] < _ATTEMPTS:
            logger.warning("group %s: its finalize worker failed (%s: %s); trying it again",
                           group.group_id, type(error).__name__, error)
            self.waiting.put(group.partition, work, first=True)   # ahead of every other
            return
        self.attempts.pop(key, None)
        self._halt(_Failed(group.partition, group.group_id,
                           f"finalize_error: worker: {type(error).__name__}: {error} "
                           f"({_ATTEMPTS} times: host memory or native code)"))

    def drain(self, budget_s: float, only: set[int] | None = None) -> list:
        """Wait (bounded) for in-flight finalizations, optionally of some partitions only; the
        Outputs that finished meanwhile."""
        finished = []
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            pending = [k for k in self.inflight if only is None or k[0] in only]
            if not pending:
                break
            time.sleep(0.01)
            finished += self.poll()
        return finished + self.poll()

    def _halt(self, out) -> None:
        """A group failed in finalization for a cause that fails every group (one of
        stage.finalize.failures.HALT_CAUSES): stop this partition here. The group stays
        unpublished and holds the committed offset, so a restart (after the cause is fixed)
        finalizes it again."""
        self.stats.inc("finalize_errors")
        if out.partition not in self.halted:
            self.halted[out.partition] = f"group {out.group_id}: {out.error}"
            logger.error("partition %d halted: group %s failed in finalization (%s). Nothing past it "
                         "is committed; fix the cause and restart the stage. Other partitions go on.",
                         out.partition, out.group_id, out.error)
        self.waiting.forget([out.partition])


class _Failed:
    """What _halt needs of a group's outcome when no Outputs came back."""

    def __init__(self, partition: int, group_id: str, error: str) -> None:
        self.partition, self.group_id, self.error = partition, group_id, error
