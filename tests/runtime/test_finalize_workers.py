"""Finalization in worker processes: a group's outputs come back from a process equal to a
thread's; a worker process that dies costs a new pool and one retry of the groups it held, and a
group that kills its worker twice halts its partition. No broker."""

import os
import signal
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from types import SimpleNamespace

from stage.decode import InputLimits
from stage.finalize import ReassemblyConfig
from stage.runtime.state.partition import Partitions
from stage.runtime.state.pauses import HALTED, reasons_of
from stage.runtime.steps.deadlines import Ready
from stage.runtime.steps.finalization import Finalization
from stage.runtime.steps.outcomes import Budget
from stage.runtime.task.pools import ProcessWorkers
from tests.fuzz.driver import Driver
from tests.fuzz.traffic import valid_traffic, workload_config


class Stats:
    def __init__(self):
        self.counts = {}

    def inc(self, name, value=1, **labels):
        self.counts[name] = self.counts.get(name, 0) + value

    def set(self, *args):
        pass

    def observe(self, *args):
        pass


class DyingWorkers:
    """Every submitted group's worker dies (as a killed process's future fails)."""

    def __init__(self):
        self.submitted, self.restarts, self.broken = [], 0, True

    def submit(self, group, why, epoch):
        self.submitted.append(group.group_id)
        future = Future()
        future.set_exception(BrokenProcessPool("a child process terminated abruptly"))
        return future

    def restart(self):
        self.restarts += 1


def test_a_group_whose_worker_dies_is_tried_again_once_then_halts_its_partition():
    parts, workers = Partitions(), DyingWorkers()
    state = parts.add(0)
    group = SimpleNamespace(group_id="g", partition=0, nbytes=10)
    fin = Finalization(workers=workers, max_inflight=8, routes_mode="off", partitions=parts,
                       stats=Stats())
    fin.offer([Ready(group, "complete", state.epoch)])
    fin.submit(Budget())
    assert fin.poll() == []                         # the first death: back in the queue
    assert fin.halted == {} and len(fin.waiting) == 1 and workers.restarts == 1
    fin.submit(Budget())
    assert fin.poll() == []                         # the second: the partition halts
    assert workers.submitted == ["g", "g"] and fin.halted[0].startswith("group g: finalize_error: worker")
    assert reasons_of(parts, halted=fin.halted)[0] == {HALTED} and not fin.waiting


def _one_group():
    """A complete group, buffered by the runtime's own intake (the fuzz driver's)."""
    driver = Driver(ReassemblyConfig())
    driver._reset()
    offsets = Counter()
    traffic = valid_traffic(workload_config(3, routes=False, media=False, groups=1))
    for record in traffic.records:
        driver._intake(record.wire(), offsets, 1_000, measure_memory=False)
    [buffer] = [b for b in driver.runtime.buffers.values() if b.groups]
    [(group, why)] = buffer.take_ready(2_000, None)[0]
    return driver, group, why


def test_worker_processes_publish_what_a_thread_publishes_and_survive_a_dead_worker():
    driver, group, why = _one_group()
    rt = driver.runtime
    by_thread = rt.pool.submit(group, why, 0).result(60)
    workers = ProcessWorkers(1, driver.cfg, InputLimits())
    try:
        by_process = workers.submit(group, why, 0).result(120)
        assert by_process.error is None and by_process.total_rows == by_thread.total_rows
        rows = lambda out: [v for t, v in out.records if t == driver.cfg.topics.canonical_rows]  # noqa: E731
        assert rows(by_process) == rows(by_thread)
        [pid] = list(workers.pool._processes)
        os.kill(pid, signal.SIGKILL)                 # killed between groups (the OOM killer)
        deadline = time.monotonic() + 30
        while not workers.broken and time.monotonic() < deadline:
            time.sleep(0.05)
        again = workers.submit(group, why, 0).result(120)   # a new pool takes the group
        assert workers.restarts == 1 and rows(again) == rows(by_thread)
    finally:
        workers.shutdown(wait=True)
