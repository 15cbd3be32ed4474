"""EndOffsetProbe and StartOffsets without a broker: answers arrive as futures the test
resolves, on a manual clock."""

from concurrent.futures import Future

from stage.buffer import ManualClock
from stage.runtime.kafka.availability import EndOffsetProbe, StartOffsets

R = ("r", 0)


class Queries:
    """Hands out futures and lets the test answer them."""

    def __init__(self):
        self.asked: list[tuple[tuple, Future]] = []

    def end_offset(self, topic, partition):
        future = Future()
        self.asked.append(((topic, partition), future))
        return future

    start_offset = end_offset

    def answer(self, value):
        _, future = self.asked[-1]
        if isinstance(value, Exception):
            future.set_exception(value)
        else:
            future.set_result(value)


def tick(clock, p, q, t: int, end_offset) -> None:
    """At ``t`` the probe asks, the broker answers ``end_offset``, the probe takes the answer."""
    clock.t = t
    p.poll()
    q.answer(end_offset)
    p.poll()


def probe(clock):
    queries = Queries()
    p = EndOffsetProbe(queries, clock.now_ms, interval_s=1.0, settle_s=3.0, slow_s=2.0)
    p.track([R])
    return p, queries


def test_read_to_the_end_only_after_the_partition_answered_for_the_settle_time():
    clock = ManualClock(0)
    p, q = probe(clock)
    for t in range(0, 5000, 1000):       # answers asked at 0, 1000, ..., 4000: end offset 10
        tick(clock, p, q, t, 10)
        assert p.note_position(*R, 10) == (t if t >= 3000 else -1)
    assert p.available(*R) and p.settled(*R)
    assert p.note_position(*R, 9) == 4000     # a later claim stays; a lower position adds none


def test_an_unanswered_question_makes_the_partition_unavailable_until_it_settles_again():
    clock = ManualClock(0)
    p, q = probe(clock)
    for t in range(0, 4000, 1000):
        tick(clock, p, q, t, 5)
        p.note_position(*R, 5)
    clock.t = 4000
    p.poll()                                   # asked at 4000: no answer (the leader died)
    clock.t = 5500
    assert p.available(*R)                     # 1.5 s: not yet judged
    clock.t = 6100
    assert not p.available(*R) and "has not answered for 2s" in p.why_unavailable(*R)
    q.answer(RuntimeError("Local: Timed out"))
    p.poll()
    assert not p.available(*R) and p.why_unavailable(*R) == "Local: Timed out"
    assert p.note_position(*R, 5) == 3000      # the claim before the failure stands, no new one
    for t in range(7100, 11200, 1000):         # answers again: 3 s of answers before a new claim
        tick(clock, p, q, t, 7)
        assert p.available(*R)
    assert p.note_position(*R, 7) == 11100 and p.settled(*R)


def test_an_answer_without_an_offset_is_a_failure_and_urgent_questions_go_out_at_once():
    clock = ManualClock(0)
    p, q = probe(clock)
    p.poll()
    q.answer(-1001)
    p.poll()
    assert not p.available(*R) and "leader unknown" in p.why_unavailable(*R)
    clock.t = 300
    p.poll()
    assert len(q.asked) == 1                   # not due before the interval...
    p.poll(urgent={R: 200})
    assert len(q.asked) == 2                   # ...unless a deadline wants an answer asked after it


def test_invalidate_voids_read_to_end_claims():
    clock = ManualClock(0)
    p, q = probe(clock)
    for t in range(0, 4000, 1000):
        tick(clock, p, q, t, 3)
    assert p.note_position(*R, 3) == 3000
    p.invalidate(*R)
    assert p.note_position(*R, -1001) == -1   # a record was put back: position unknown again


def test_start_offsets_are_asked_once_and_retried_after_a_failure():
    q = Queries()
    starts = StartOffsets(q, retry_s=1.0)
    assert starts.get("r", 0, 0.0) == -1 and len(q.asked) == 1
    q.answer(RuntimeError("coordinator not available"))
    assert starts.get("r", 0, 0.1) == -1 and len(q.asked) == 1   # failed: wait before asking again
    assert starts.get("r", 0, 1.2) == -1 and len(q.asked) == 2
    q.answer(42)
    assert starts.get("r", 0, 1.3) == 42 and starts.get("r", 0, 9.0) == 42 and len(q.asked) == 2
