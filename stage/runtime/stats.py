"""Runtime counters and gauges, kept as plain numbers; observability exports them."""

from __future__ import annotations

import threading
import time
from collections import Counter


class RuntimeStats:
    """Counters for tests and reports; every update is mirrored to ``sink`` (Prometheus)."""

    def __init__(self, sink=None) -> None:
        if sink is None:
            from stage.observability.metrics import PrometheusSink
            sink = PrometheusSink()
        self.sink = sink
        self._lock = threading.Lock()
        self.counters: Counter = Counter()
        self.gauges: dict[str, float] = {}
        self.observations: dict[str, list[float]] = {}
        self.last_loop_at = time.monotonic()

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self.counters[key] += value
        self.sink.inc(name, value, labels)

    def set(self, name: str, value: float) -> None:
        self.gauges[name] = value
        self.sink.set(name, value)

    def observe(self, name: str, value: float) -> None:
        self.sink.observe(name, value)
        with self._lock:
            self.observations.setdefault(name, []).append(value)
            if len(self.observations[name]) > 10_000:
                del self.observations[name][:5_000]

    def count(self, name: str, **labels) -> float:
        return self.counters[(name, tuple(sorted(labels.items())))]

    def total(self, name: str) -> float:
        return sum(v for (n, _), v in self.counters.items() if n == name)

    def activity(self) -> float:
        """The sum of every counter: it moves whenever the stage does anything (consumes,
        publishes, dead-letters, rebalances). Safe to call from any thread."""
        with self._lock:
            return sum(self.counters.values())

    def heartbeat(self) -> None:
        self.last_loop_at = time.monotonic()
