"""Can the stage reach its brokers? Told by librdkafka's error callbacks, answered by a new
producer.

librdkafka reports ``_ALL_BROKERS_DOWN`` through a client's ``error_cb`` as soon as its last
broker connection fails (a refused or reset connection: at once; a silent network partition:
once the socket times out). The consumer's callback tells this (it is served on the loop
thread at every poll; an idle producer is not polled, so its callbacks would arrive late,
after the outage). From then until a producer has been initialized
again (``init_transactions`` answered by the transaction coordinator, or a metadata answer
in at-least-once mode: stage.runtime.steps.flight), readiness is false and the stage opens no
transaction. Each outage is numbered, so a recovery answers only the outage it was started
for: the brokers going away again meanwhile is a new outage.

Written only by its own methods (the callback on the loop thread, a recovery on the publisher
replacement's): a lock keeps the three fields together.
"""

from __future__ import annotations

import logging
import threading
import time

from confluent_kafka import KafkaError

from stage.runtime.kafka.logs import kafka_logger

logger = logging.getLogger("stage.runtime.loop")

# "No broker answers": every connection of the client failed (refused, reset, timed out or
# unresolvable). One broker of several failing is a failover, not an outage.
_UNREACHABLE = frozenset({KafkaError._ALL_BROKERS_DOWN})


class BrokerHealth:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self.down_since: float | None = None   # when the current outage began, None: none
        self.reason = ""                        # the error that began it
        self.outage = 0                         # outages seen so far (the current one's number)

    # -- told by the clients ---------------------------------------------------------------
    def error_callback(self, client: str):
        """An ``error_cb`` for one client (``client`` names it in the log)."""
        log = kafka_logger()

        def on_error(err: KafkaError) -> None:
            # librdkafka's own log line for these is suppressed once an error_cb is set
            log.warning("%s: %s", client, err.str())
            if err.code() in _UNREACHABLE:
                self.unreachable(f"{client}: {err.str()}")
        return on_error

    def unreachable(self, reason: str) -> None:
        with self._lock:
            if self.down_since is not None:
                return
            self.down_since, self.reason = self.clock(), reason
            self.outage += 1
            outage = self.outage
        logger.warning("brokers unreachable (outage %d: %s): readiness is false and no transaction "
                       "is opened until a new producer is initialized", outage, reason)

    def recovered(self, outage: int) -> bool:
        """A producer was initialized after outage number ``outage`` began: that outage is over
        (not a later one). True if this ended the current outage."""
        with self._lock:
            if self.down_since is None or outage != self.outage:
                return False
            # said before readiness can turn true, so the log orders the two
            logger.info("brokers reachable again: a new producer was initialized %.1fs after the "
                        "outage began", self.clock() - self.down_since)
            self.down_since = None
        return True

    # -- asked by the runtime --------------------------------------------------------------
    def down(self) -> tuple[int, float] | None:
        """(outage number, seconds since it began), or None when the brokers are reachable."""
        with self._lock:
            if self.down_since is None:
                return None
            return self.outage, self.clock() - self.down_since

    def describe(self) -> str | None:
        """Why readiness is false, or None."""
        with self._lock:
            if self.down_since is None:
                return None
            return (f"brokers unreachable for {self.clock() - self.down_since:.0f}s ({self.reason}); "
                    "ready again once a new producer is initialized and the partitions are assigned")
