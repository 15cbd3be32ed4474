"""Where finalization runs: threads of this process, or worker processes.

Finalization is mostly Python (row checks, Avro encoding) around hashing and array work: two
threads finalize little faster than one (the GIL), so a replica given more cores uses worker
processes (``finalize_pool: process``): each group is pickled to a process (its buffered
records, decoded once on the poll thread) and its encoded outputs come back. Measured on the
agentic-moe profile without routes, 2 processes finalize 1.58x as fast as 1 thread; with direct
routes (~100 MB a group to and from the process) 1.11x (docs/performance.md).

A worker process sets itself up as the stage does: the allocator tuning, one torch thread, the
stage's codecs (output schemas resolved once when it starts). It has no shared route-dims cache
with the stage: configure ``finalize.route_layers`` / ``route_topk`` in direct router replay.
If a worker process dies (killed for memory, a crash in native code), the pool is made anew and
the groups it held are handed back to the finalize step, which tries each at most twice before
it halts their partition (stage.runtime.steps.finalization).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from stage.runtime.task.finalize_task import finalize_and_encode

logger = logging.getLogger(__name__)

THREAD, PROCESS = "thread", "process"


class ThreadWorkers:
    """Finalization on threads of this process (the default: one)."""

    def __init__(self, workers: int, task: dict) -> None:
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="finalize")
        self.task = task     # keyword arguments of finalize_and_encode beyond the group

    def warm(self, timeout_s: float = 0.0) -> None:
        pass

    def submit(self, group, why: str, epoch: int) -> Future:
        return self.pool.submit(finalize_and_encode, group, why, epoch, **self.task)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


# -- worker processes -----------------------------------------------------------------------
_PROCESS_STATE: dict = {}


def _init_process(cfg, limits) -> None:
    """A worker process's set-up, once (stage.runtime.loop.StageRuntime.start's, in small)."""
    import torch

    from stage.routes import RouteDimsCache
    from stage.runtime.malloc import tune_malloc
    from stage.runtime.kafka.registry import build_codecs
    from stage.wire import OUTPUT_RECORDS
    tune_malloc()
    torch.set_num_threads(1)
    codecs = build_codecs(cfg)
    for name in OUTPUT_RECORDS:
        codecs[name].ensure_registered()    # ids from the registry (no-op with plain framing)
    _PROCESS_STATE.update(cfg=cfg, limits=limits, codecs=codecs, dims=RouteDimsCache())


def _ready() -> int:
    time.sleep(0.2)   # held a moment, so that each warm-up call lands on another process
    return os.getpid()


def _now_ms() -> int:
    return int(time.time() * 1000)


def _finalize_in_process(group, why: str, epoch: int):
    state = _PROCESS_STATE
    cfg = state["cfg"]
    return finalize_and_encode(group, why, epoch, config=cfg.finalize, dims_cache=state["dims"],
                               codecs=state["codecs"], topics=cfg.topics, limits=state["limits"],
                               now_ms=_now_ms)


class ProcessWorkers:
    """Finalization in ``workers`` processes (spawned: no state of this process leaks in)."""

    def __init__(self, workers: int, cfg, limits) -> None:
        self.workers, self.cfg, self.limits = workers, cfg, limits
        self.restarts = 0
        self.pool = self._make()

    def _make(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_process, initargs=(self.cfg, self.limits))

    def warm(self, timeout_s: float = 300.0) -> None:
        """Start every worker process now (each imports torch and resolves the codecs: seconds),
        before the stage joins its group, so the first groups do not wait for them."""
        futures = [self.pool.submit(_ready) for _ in range(self.workers)]
        for future in futures:
            future.result(timeout_s)

    def submit(self, group, why: str, epoch: int) -> Future:
        try:
            return self.pool.submit(_finalize_in_process, group, why, epoch)
        except BrokenProcessPool:   # a worker died between groups: the pool refuses new work
            logger.error("a finalize worker process died; starting a new pool")
            self.restart()
            return self.pool.submit(_finalize_in_process, group, why, epoch)

    @property
    def broken(self) -> bool:
        return bool(getattr(self.pool, "_broken", False))

    def restart(self) -> None:
        """A worker process died (the pool is broken): a new pool for what comes next."""
        self.restarts += 1
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = self._make()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def make_workers(cfg, *, task: dict, limits):
    if cfg.finalize_pool == PROCESS:
        return ProcessWorkers(cfg.finalize_workers, cfg, limits)
    return ThreadWorkers(cfg.finalize_workers, task)
