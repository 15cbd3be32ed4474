"""The one transaction in flight, on the publisher thread, and the producer it runs on.

The producer is replaced, in process, in two cases; the replacement (a new producer with the
same transactional.id, started on its own thread) fences the old one with its
init_transactions, which aborts the old one's open transaction, or completes it if its commit
had reached the coordinator:

- the brokers were seen unreachable (stage.runtime.kafka.health: librdkafka's
  ``_ALL_BROKERS_DOWN``): the replacement starts at once and keeps trying until the brokers
  answer, however long that takes. A transaction coordinator that went away and came back
  leaves librdkafka's transactional calls waiting forever (librdkafka #5511, #5456), so the
  old producer is not trusted with another transaction; a fresh one is ready the moment the
  coordinator answers. No transaction is opened meanwhile, and readiness is false until it is
  ready.
- a coordinator call (begin, send offsets, commit, abort: milliseconds, whatever the batch
  size) has not returned in ``publish_stuck_ms``, with no outage seen (#5511 after a
  coordinator moved).

A transaction cut short by a replacement raises ``Rewind`` (the stage re-reads from the
committed offsets); which way it went is logged once its partitions' ledgers are read again
(stage.runtime.steps.publication). A transaction that failed because the brokers aborted it
(it outlived ``transaction_timeout_ms`` while they were unreachable: the coordinator bumps the
epoch, which fences the producer) is the same case, not a second process with this
transactional.id: it gets a replacement and a rewind, not exit 6. The stuck call is left on
its abandoned thread. Only a forced wait (shutdown) gives up, once the brokers would have
aborted the transaction themselves (transaction timeout + their sweep): then the stage exits 8.

Owns: the publisher (made by ``new_publisher``, replaced only here), the flight (future,
outputs, batch) and when it began, a producer replacement in progress and the outage it
answers, the producers walked away from, and the groups of a transaction cut short (until
their ledgers tell its outcome). Outcomes: a replaced flight raises ``Rewind``; one that
cannot be recovered raises a ``StageExit``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait

from confluent_kafka import KafkaException

from stage.publish import StageFatal
from stage.publish.transaction import ABORT, COMMIT, COORDINATOR_CALLS, FLUSH, IDLE, PRODUCE
from stage.runtime import exits
from stage.runtime.kafka.health import BrokerHealth
from stage.runtime.state.memory import PRODUCER_COPIES
from stage.runtime.steps.outcomes import Rewind

logger = logging.getLogger("stage.runtime.loop")

# Kafka's transaction.abort.timed.out.transaction.cleanup.interval.ms (10 s) and a margin.
_ABORT_SWEEP_S = 15.0
_FORCED_WAIT_STEP_S = 0.05
# A coordinator call unanswered this long makes readiness false (it is replaced only at
# publish_stuck_ms): it answers in milliseconds when the coordinator is there.
_UNANSWERED_S = 5.0
# Records produced in a transaction and none acknowledged this long makes readiness false too (a
# held Produce request waits up to librdkafka's request.timeout.ms, 30 s, before it is retried);
# not a reason to replace the producer: a large record on a slow link is acknowledged late.
_DELIVERING = frozenset({PRODUCE, FLUSH})
# Between attempts to start a replacement while the brokers do not answer (each attempt
# itself waits up to transaction_timeout_ms for them).
_RETRY_FIRST_S, _RETRY_MAX_S = 0.25, 2.0
_CUT_SHORT_KEPT = 10_000   # groups whose transaction outcome is still to be logged, at most


class Flight:
    def __init__(self, cfg, *, pool, stats, new_publisher=None, recover: bool = True,
                 health: BrokerHealth | None = None) -> None:
        self.cfg = cfg
        self.pool = pool                    # DetachedWorker: one transaction at a time
        self.stats = stats
        self.new_publisher = new_publisher  # () -> a started publisher
        self.recover = recover              # replace a stuck producer (exactly-once only)
        self.health = health if health is not None else BrokerHealth()   # read: outages
        self.stuck_after_s = min(cfg.publish_stuck_ms, cfg.transaction_timeout_ms) / 1000
        self.publisher = None
        self.current = None                 # (future, outputs, batch) or None
        self.started_at = 0.0
        self._outage_at_launch = 0          # the health's outage count when the flight began
        self._unacked = (0, 0.0)            # (records the producer holds, since when that count)
        self.replacing: Future | None = None   # a new publisher being started
        self._replacing_for: int | None = None   # the outage it answers (None: a stuck call)
        self._stuck_phase, self._stuck_at = "", 0.0
        self._closing = threading.Event()   # replacements stop retrying
        self.abandoned: list = []           # stuck publishers, kept referenced (never destroyed here)
        self.cut_short: list[tuple[int, str]] = []   # (partition, group id) of a replaced flight

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
    def settled(self) -> bool:
        """The flight is done and may be landed: it succeeded, or it failed with no replacement
        under way (a failed flight that a replacement answers waits for it: the rewind then
        happens with the brokers back)."""
        if not self.done:
            return False
        return self.current[0].exception() is None or self.replacing is None

    @property
    def can_launch(self) -> bool:
        """A new transaction may start: no replacement under way, no outage."""
        return self.replacing is None and self.health.down() is None

    @property
    def nbytes(self) -> int:
        """The batch in flight, with librdkafka's copy of it (stage.runtime.state.memory)."""
        if self.current is None:
            return 0
        return PRODUCER_COPIES * sum(len(record[3]) for record in self.current[2].records if record[3])

    def launch(self, outputs, batch, consumer) -> None:
        self.current = (self.pool.submit(self._timed_publish, batch, consumer), outputs, batch)
        self.started_at = time.monotonic()
        self._outage_at_launch = self.health.outage
        self._unacked = (0, self.started_at)

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

    def _call_age(self) -> tuple[str, float]:
        """The call the flight is in and for how long ("" when none is running)."""
        if self.current is None or self.current[0].done():
            return "", 0.0
        phase = getattr(self.publisher, "phase", IDLE)
        return phase, time.monotonic() - getattr(self.publisher, "phase_since", time.monotonic())

    def stuck(self) -> str | None:
        """Why publishing does not work now (for readiness), or None."""
        if self.replacing is not None:
            what = ("the brokers were unreachable" if self._replacing_for is not None
                    else f"publication stuck in {self._stuck_phase}")
            return (f"{what}: replacing the producer (fences the old one) for "
                    f"{time.monotonic() - self._stuck_at:.0f}s")
        phase, age = self._call_age()
        if phase in COORDINATOR_CALLS and age > min(self.stuck_after_s, _UNANSWERED_S):
            return f"publication stuck in {phase} for {age:.0f}s (the transaction coordinator does not answer)"
        if phase in _DELIVERING:
            held, since = self._note_deliveries()
            waited = time.monotonic() - since
            if held and waited > _UNANSWERED_S:
                return (f"publication in {phase}: {held} records unacknowledged, none acknowledged for "
                        f"{waited:.0f}s (a partition leader does not answer)")
        return None

    def _note_deliveries(self) -> tuple[int, float]:
        """(records the producer still holds, since when that count has not moved)."""
        outstanding = getattr(self.publisher, "outstanding", None)
        if outstanding is None:
            return 0, time.monotonic()
        held = outstanding()
        if held != self._unacked[0]:
            self._unacked = (held, time.monotonic())
        return self._unacked

    def watch(self, forced: bool = False) -> None:
        """Every iteration, and while a forced publish waits: start a replacement (the brokers
        were seen unreachable, or the call in flight is stuck), finish one that is ready
        (``Rewind`` when it cut a transaction short). ``forced`` (shutdown): give up at the
        stall deadline (``StageExit``)."""
        if self._call_age()[0] in _DELIVERING:
            self._note_deliveries()     # every iteration: a count that moved between two readiness polls
        if self.replacing is not None:
            if self.replacing.done():
                self._replaced()
            elif forced and self.in_flight and not self.done and time.monotonic() > self._stall_deadline():
                self._stalled()
            return
        down = self.health.down()
        if down is not None and self.new_publisher is not None:
            self._replace(outage=down[0], why="the brokers were unreachable")
            return
        if self.done:
            if self.current[0].exception() is not None and self._aborted_by_brokers():
                self._replace(outage=None, why="the brokers aborted the transaction in flight (it "
                                               "outlived transaction_timeout_ms, or they went away "
                                               "while it ran)")
            return
        phase, age = self._call_age()
        if not phase:
            return
        if (self.recover and self.new_publisher is not None and phase in COORDINATOR_CALLS
                and age > self.stuck_after_s):
            self._replace(outage=None, why=f"publication stuck in {phase} for {age:.0f}s (librdkafka "
                                           "#5511 after a coordinator moved)")
        elif time.monotonic() > self._stall_deadline():
            self._stalled()

    def wait(self) -> None:
        """Shutdown or revoke: wait for the flight, recovering it if it is stuck (bounded by
        the stall deadline)."""
        while self.current is not None and not self.current[0].done():
            self.watch(forced=True)
            if self.current is not None:
                wait([self.current[0]], timeout=_FORCED_WAIT_STEP_S)

    def _aborted_by_brokers(self) -> bool:
        """The failed flight's producer was fenced by the brokers' own abort of its transaction
        (it outlived the transaction timeout, or the brokers went away while it ran), not by
        another process with this transactional.id."""
        error = self.current[0].exception()
        if not (self.recover and self.new_publisher is not None and isinstance(error, StageFatal)):
            return False
        outlived = time.monotonic() - self.started_at > self.cfg.transaction_timeout_ms / 1000
        return outlived or self.health.outage != self._outage_at_launch

    def _replace(self, *, outage: int | None, why: str) -> None:
        publisher = self.publisher
        self._stuck_phase = getattr(publisher, "phase", IDLE)
        self._stuck_at = time.monotonic()
        self._replacing_for = outage
        logger.warning("%s: starting a new producer with transactional.id %s to fence the old one "
                       "(%s)", why, self.cfg.effective_transactional_id, self._open_transaction())
        if outage is None:
            self.stats.inc("publication_stuck")
        self.replacing = Future()
        threading.Thread(target=self._start_publisher, args=(self.replacing,),
                         name="publisher-replacement", daemon=True).start()

    def _open_transaction(self) -> str:
        """What the fence does to the transaction in flight, as far as this process can know:
        the old producer goes on until the new one fences it, so a commit may still land."""
        if not self.in_flight:
            return "no transaction is open"
        if self.done:
            return ("the transaction in flight has ended: "
                    + ("committed" if self.current[0].exception() is None else "failed, so aborted"))
        return (f"the transaction in flight, in {self._stuck_phase}, is committed if its commit reaches "
                "the transaction coordinator before the fence, else the fence aborts it; the log says "
                "which")

    def _start_publisher(self, result: Future) -> None:
        """Start a new publisher, retrying for as long as the brokers do not answer; only a
        fatal error (authorization, configuration) ends it."""
        pause, attempts = _RETRY_FIRST_S, 0
        while True:
            try:
                result.set_result(self.new_publisher())
                return
            except KafkaException as error:
                err = error.args[0]
                if err.fatal() or self._closing.is_set():
                    result.set_exception(error)
                    return
                attempts += 1
                if attempts in (1, 10) or attempts % 100 == 0:   # a few lines for a long outage
                    logger.warning("the new producer could not start yet (%s; attempt %d); retrying "
                                   "until the brokers answer", err, attempts)
                if self._closing.wait(pause):
                    result.set_exception(error)
                    return
                pause = min(2 * pause, _RETRY_MAX_S)
            except BaseException as error:  # noqa: BLE001 - handed to the loop thread
                result.set_exception(error)
                return

    def _replaced(self) -> None:
        """The new producer is ready (it fenced the old one): use it; a flight it cut short is
        abandoned and the stage rewinds."""
        replacing, self.replacing = self.replacing, None
        outage, self._replacing_for = self._replacing_for, None
        try:
            publisher = replacing.result()
        except Exception as error:  # noqa: BLE001 - a fatal error: the stage stops with it
            logger.error("no replacement producer (%s: %s)", type(error).__name__, error)
            raise exits.kafka_fatal(f"a new producer could not be started: {error}") from None
        old, self.publisher = self.publisher, publisher
        seconds = time.monotonic() - self._stuck_at
        if outage is not None:
            self.health.recovered(outage)
        current = self.current
        committed = current is not None and current[0].done() and current[0].exception() is None
        if committed:
            current = None   # it committed before the fence: landed as usual
        self._retire(old, stuck=current is not None and not current[0].done())
        if current is None:
            logger.info("new producer ready %.1fs after it was started; %spublishing goes on", seconds,
                        "the transaction in flight committed before the fence; " if committed else "")
            return
        if not current[0].done():
            self.pool.abandon()
        self.current = None
        self.stats.inc("publication_recoveries")
        self.stats.observe("publication_recovery_seconds", seconds)
        outputs = current[1]
        self.cut_short.extend((out.partition, out.group_id) for out in outputs)
        del self.cut_short[:-_CUT_SHORT_KEPT]
        logger.warning("new producer ready %.1fs after it was started; the transaction in flight (%d "
                       "groups) was committed if its commit had reached the coordinator, else it is "
                       "aborted: the ledger tells which once it is read again; rewinding to the "
                       "committed offsets", seconds, len(outputs))
        raise Rewind("a transaction cut short by a new producer")

    def _retire(self, publisher, *, stuck: bool) -> None:
        """An old producer: kept referenced when a call is stuck in it (destroying it could
        block), else closed on a thread of its own (it is fenced: nothing is left to send)."""
        if publisher is None:
            return
        if stuck:
            self.abandoned.append(publisher)
            return
        threading.Thread(target=publisher.close, kwargs={"timeout_s": 1.0}, name="publisher-close",
                         daemon=True).start()

    def cut_short_of(self, partition: int) -> list[str]:
        """The groups of ``partition`` in a transaction cut short, handed over once (to be
        looked up in its ledger)."""
        mine = [group_id for p, group_id in self.cut_short if p == partition]
        if mine:
            self.cut_short = [(p, g) for p, g in self.cut_short if p != partition]
        return mine

    def _stalled(self) -> None:
        age = time.monotonic() - self.started_at
        logger.error("publication stuck for %.0fs in the Kafka client; stopping", age)
        raise exits.publish_stalled(age, self.cfg.effective_transactional_id)

    def close(self) -> None:
        self._closing.set()
        if self.publisher is not None:
            self.publisher.close()
