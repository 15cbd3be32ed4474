"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time


def time_per_call(fn, *, min_seconds: float = 0.5, rounds: int = 5, clock=time.perf_counter) -> dict:
    """Median and best seconds per call of ``fn`` over ``rounds`` rounds of >= min_seconds/rounds.

    ``clock=time.process_time`` counts this process's CPU seconds only: single-threaded work
    compared side by side on a machine other jobs share (the time it is preempted is not
    counted; what the other jobs do to caches and memory bandwidth still is)."""
    fn()  # warm-up
    per_round = max(min_seconds / rounds, 0.01)
    samples = []
    for _ in range(rounds):
        n = 0
        start = clock()
        while True:
            fn()
            n += 1
            elapsed = clock() - start
            if elapsed >= per_round:
                break
        samples.append(elapsed / n)
    return {"median_s": statistics.median(samples), "best_s": min(samples), "rounds": rounds}
