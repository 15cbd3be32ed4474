"""The one transaction in flight, on the publisher thread, and the producer it runs on.

A publication stuck in a coordinator call (librdkafka #5511: send_offsets_to_transaction waits
forever on a coordinator whose broker restarted) is recovered in process: once the call has
not returned in ``publish_stuck_ms``, a new producer with the same transactional.id is started
on its own thread; its init_transactions fences the stuck producer and aborts (or completes)
its transaction, and the stage rewinds to the committed offsets as after any abort. The stuck
call is left on its abandoned thread. Only if no new producer is ready by the time the brokers
abort the transaction themselves (transaction timeout + their sweep) does the stage stop.

Owns: the publisher (made by ``new_publisher``, replaced only here), the flight (future,
outputs, batch) and when it began, a producer replacement in progress, the producers walked
away from. Outcomes: a replaced flight raises ``Rewind``; one that cannot be recovered raises
the ``StageExit`` of a stalled publication.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait

from confluent_kafka import KafkaException

from stage.publish.transaction import COORDINATOR_CALLS, IDLE
from stage.runtime import exits
from stage.runtime.state.memory import PRODUCER_COPIES
from stage.runtime.steps.outcomes import Rewind

logger = logging.getLogger("stage.runtime.loop")

# Kafka's transaction.abort.timed.out.transaction.cleanup.interval.ms (10 s) and a margin.
_ABORT_SWEEP_S = 15.0
_FORCED_WAIT_STEP_S = 0.05


class Flight:
    def __init__(self, cfg, *, pool, stats, new_publisher=None, recover: bool = True) -> None:
        self.cfg = cfg
        self.pool = pool                    # DetachedWorker: one transaction at a time
        self.stats = stats
        self.new_publisher = new_publisher  # () -> a started publisher
        self.recover = recover              # replace a stuck producer (exactly-once only)
        self.stuck_after_s = min(cfg.publish_stuck_ms, cfg.transaction_timeout_ms) / 1000
        self.publisher = None
        self.current = None                 # (future, outputs, batch) or None
        self.started_at = 0.0
        self.replacing: Future | None = None   # a new publisher being started
        self._stuck_phase, self._stuck_at = "", 0.0
        self.abandoned: list = []           # stuck publishers, kept referenced (never destroyed here)

    def start(self) -> None:
        """The first publisher (in exactly-once mode, its init_transactions fences any earlier
        producer with this transactional.id). Raises StageFatal."""
        self.publisher = self.new_publisher()

    @property
    def in_flight(self) -> bool:
        return self.current is not None

    @property
    def done(self) -> bool:
        return self.current is not None and self.current[0].done()

    @property
    def nbytes(self) -> int:
        """The batch in flight, with librdkafka's copy of it (stage.runtime.state.memory)."""
        if self.current is None:
            return 0
        return PRODUCER_COPIES * sum(len(record[3]) for record in self.current[2].records if record[3])

    def launch(self, outputs, batch, consumer) -> None:
        self.current = (self.pool.submit(self._timed_publish, batch, consumer), outputs, batch)
        self.started_at = time.monotonic()

    def take(self):
        """The finished flight (future, outputs, batch), no longer in flight."""
        current, self.current = self.current, None
        return current

    def _timed_publish(self, batch, consumer) -> float:
        started = time.monotonic()
        self.publisher.publish(batch, consumer)
        return time.monotonic() - started

    # -- a publication that does not come back --------------------------------------------
    def _stall_deadline(self) -> float:
        """Past the transaction timeout (plus the brokers' abort sweep) a publication can no
        longer commit: the brokers abort it. A call still running then is stuck, not slow."""
        return self.started_at + self.cfg.transaction_timeout_ms / 1000 + _ABORT_SWEEP_S

    def stuck(self) -> str | None:
        """Why the publication in flight counts as stuck (for readiness), or None."""
        if self.current is None or self.current[0].done():
            return None
        phase = getattr(self.publisher, "phase", IDLE)
        age = time.monotonic() - getattr(self.publisher, "phase_since", time.monotonic())
        if self.replacing is not None:
            return (f"publication stuck in {self._stuck_phase}: replacing the producer (fences the "
                    f"stuck one) for {time.monotonic() - self._stuck_at:.0f}s")
        if phase in COORDINATOR_CALLS and age > self.stuck_after_s:
            return f"publication stuck in {phase} for {age:.0f}s"
        return None

    def watch(self) -> None:
        """The flight is not done: finish a replacement (Rewind), start one, or give up
        (StageExit)."""
        if self.replacing is not None:
            if self.replacing.done():
                self._replaced()
                return
        elif self.recover and self.new_publisher is not None and self.stuck() is not None:
            self._replace()
            return
        if time.monotonic() > self._stall_deadline():
            self._stalled()

    def wait(self) -> None:
        """Shutdown or revoke: wait for the flight, recovering it if it is stuck (bounded by
        the stall deadline)."""
        while self.current is not None and not self.current[0].done():
            self.watch()
            if self.current is not None:
                wait([self.current[0]], timeout=_FORCED_WAIT_STEP_S)

    def _replace(self) -> None:
        publisher = self.publisher
        self._stuck_phase = publisher.phase
        self._stuck_at = time.monotonic()
        logger.error("publication stuck in %s for %.0fs (librdkafka #5511 after a broker restart); "
                     "starting a new producer with transactional.id %s to fence it and abort its "
                     "transaction", publisher.phase, time.monotonic() - publisher.phase_since,
                     self.cfg.effective_transactional_id)
        self.stats.inc("publication_stuck")
        self.replacing = Future()
        threading.Thread(target=self._start_publisher, args=(self.replacing,),
                         name="publisher-replacement", daemon=True).start()

    def _start_publisher(self, result: Future) -> None:
        """Start a new publisher, retrying while the brokers cannot answer, until the stall
        deadline (then the stage stops as before)."""
        deadline = self._stall_deadline()
        while True:
            try:
                result.set_result(self.new_publisher())
                return
            except KafkaException as error:
                err = error.args[0]
                if err.fatal() or time.monotonic() > deadline:
                    result.set_exception(error)
                    return
                logger.warning("the replacement producer could not start yet (%s); retrying", err)
                time.sleep(1.0)
            except BaseException as error:  # noqa: BLE001 - handed to the loop thread
                result.set_exception(error)
                return

    def _replaced(self) -> None:
        """The new producer fenced the stuck one: abandon the stuck call and start over."""
        replacing, self.replacing = self.replacing, None
        try:
            publisher = replacing.result()
        except Exception as error:  # noqa: BLE001 - no producer: stop as a stuck publication does
            logger.error("no replacement producer (%s: %s)", type(error).__name__, error)
            self._stalled()
        self.abandoned.append(self.publisher)
        self.publisher = publisher
        self.pool.abandon()
        self.current = None
        seconds = time.monotonic() - self._stuck_at
        self.stats.inc("publication_recoveries")
        self.stats.observe("publication_recovery_seconds", seconds)
        logger.warning("new producer ready %.1fs after the publication was found stuck; the stuck "
                       "transaction is aborted, rewinding to the committed offsets", seconds)
        raise Rewind("a stuck publication was fenced by a new producer")

    def _stalled(self) -> None:
        age = time.monotonic() - self.started_at
        logger.error("publication stuck for %.0fs in the Kafka client; stopping", age)
        raise exits.publish_stalled(age, self.cfg.effective_transactional_id)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
