"""Do the brokers answer? Asked every second, so that a silent network partition is an outage
within seconds.

librdkafka reports ``_ALL_BROKERS_DOWN`` (stage.runtime.kafka.health) only once its last
connection fails: at once for a refused or reset connection, but a silent partition (packets
dropped, connections left open) fails a connection only when a request on it times out
(``socket.timeout.ms``, 60 s), and a partition that heals first is never reported at all: the
replica kept a producer whose coordinator calls could then hang (librdkafka #5511) and answered
ready meanwhile. Two witnesses, both silent for ``silent_after_s``, make an outage:

- a metadata request for the lead input topic, sent once a second on a thread of its own with
  ``silent_after_s`` to answer, none answered since the first one sent that long ago (librdkafka
  sends it on one of the few connections the querying client holds: alone it would call one
  broker of several cut off an outage);
- the consumer's own connections (its fetches, at least every ``fetch.wait.max.ms``, and its
  heartbeats): librdkafka's statistics, read every second, say how long since each connected
  broker last sent it anything (``rxidle``); the consumer alone would call a long JoinGroup wait
  with nothing fetched an outage.

Then ``BrokerHealth.unreachable``: readiness false, and a new producer (stage.runtime.steps.flight)
that fences the old one once the brokers answer. One broker of several cut off is a failover, not
an outage (the consumer still hears from the others). The outage ends only where it always does:
a new producer initialized.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from stage.runtime.kafka.health import BrokerHealth

EVERY_S = 1.0          # a metadata request a second: a few hundred bytes each way
SILENT_AFTER_S = 5.0   # no answer for this long (with a request waiting as long): unreachable
_IN_FLIGHT = 6         # requests waiting at most: each waits up to SILENT_AFTER_S


class BrokerLiveness:
    def __init__(self, ask, health: BrokerHealth, *, every_s: float = EVERY_S,
                 silent_after_s: float = SILENT_AFTER_S, clock=time.monotonic) -> None:
        """``ask(timeout_s)``: one request to the brokers, raising when none answers in time."""
        self.ask, self.health, self.clock = ask, health, clock
        self.every_s, self.silent_after_s = every_s, silent_after_s
        self._lock = threading.Lock()
        self._waiting = 0                 # requests sent and not answered or failed yet
        self._unanswered_since: float | None = None   # the first request sent since the last answer
        self._last_error = ""
        self._outage = health.outage       # the last outage seen: one that began or ended resets the count
        self._consumer_heard: float | None = None   # when a broker last sent the consumer anything
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(_IN_FLIGHT, thread_name_prefix="broker-liveness")
        self._thread = threading.Thread(target=self._run, name="broker-liveness", daemon=True)

    def start(self) -> "BrokerLiveness":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop asking; waits for a request still out (at most ``silent_after_s``): the client
        it uses is closed next."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def consumer_stats(self, stats_json: str) -> None:
        """The consumer's librdkafka statistics (its ``stats_cb``, on the loop thread)."""
        now = self.clock()
        try:
            brokers = json.loads(stats_json).get("brokers", {}).values()
            idle = [b["rxidle"] for b in brokers if b.get("state") == "UP" and b.get("source") != "internal"
                    and isinstance(b.get("rxidle"), int) and b["rxidle"] >= 0]
        except (ValueError, AttributeError, KeyError, TypeError):
            return
        with self._lock:
            heard = now - min(idle) / 1e6 if idle else None
            if self._consumer_heard is None:
                self._consumer_heard = now if heard is None else heard
            elif heard is not None:
                self._consumer_heard = max(self._consumer_heard, heard)

    # -- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.tick()

    def tick(self) -> None:
        """Send a request if fewer than ``_IN_FLIGHT`` wait, then judge (also called by tests)."""
        with self._lock:
            room = self._waiting < _IN_FLIGHT
            if room:
                self._waiting += 1
                if self._unanswered_since is None:
                    self._unanswered_since = self.clock()
        if room:
            try:
                self._pool.submit(self._one)
            except RuntimeError:   # stopped
                return
        self.judge()

    def _one(self) -> None:
        try:
            self.ask(self.silent_after_s)
        except Exception as error:  # noqa: BLE001 - any failure is "no answer"
            with self._lock:
                self._waiting -= 1
                self._last_error = f"{type(error).__name__}: {error}"
            return
        with self._lock:
            self._waiting -= 1
            self._unanswered_since = None

    def judge(self) -> bool:
        """True when this call began an outage."""
        now = self.clock()
        down = self.health.down()
        with self._lock:
            if down is not None or self.health.outage != self._outage:
                # during an outage (its end is a new producer initialized), and after it: afresh
                self._outage, self._unanswered_since = self.health.outage, None
                return False
            since, error, heard = self._unanswered_since, self._last_error, self._consumer_heard
            if since is None or now - since < self.silent_after_s:
                return False
            if heard is not None and now - heard < self.silent_after_s:
                return False      # the consumer hears from a broker: one of several is cut off
            self._unanswered_since = None
        consumer = "" if heard is None else f", nor any broker the consumer for {now - heard:.1f}s"
        self.health.unreachable(f"no broker answered a metadata request for {now - since:.1f}s{consumer}"
                                + (f" ({error})" if error else ""))
        return True
