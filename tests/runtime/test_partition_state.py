"""Partitions (the assigned partitions' states) and the steps' queues without a broker:
results match a partition only by its current epoch, a step's queue is taken across
partitions in the order it was filled and forgets a partition whole, and dead-letter marks
say once whether an offset was dead-lettered before."""

from stage.runtime.state.partition import DeadLetterMarks, Partitions
from stage.runtime.state.queue import PartitionQueue


def test_dropping_a_partition_forgets_it_and_only_it():
    parts, done = Partitions(), PartitionQueue()
    parts.add(0), parts.add(1)
    done.put(0, "out-a")
    done.put(1, "out-b")
    dropped = parts.drop({0})
    done.forget({0})
    assert [s.number for s in dropped] == [0]
    assert parts.numbers() == [1] and parts.get(0) is None and 0 not in parts
    assert done.items() == ["out-b"]


def test_a_result_belongs_to_a_partition_only_at_the_epoch_it_was_taken():
    parts = Partitions()
    first = parts.add(3)
    taken_at = first.epoch
    first.epoch = parts.next_epoch()          # reloaded (a rewind)
    assert parts.current(3, taken_at) is None and parts.current(3, first.epoch) is first
    parts.drop({3})
    again = parts.add(3)                       # assigned again later: a new, unseen epoch
    assert again.epoch not in (taken_at, first.epoch) and parts.current(3, first.epoch) is None


def test_the_oldest_items_are_taken_across_partitions_in_queue_order():
    waiting = PartitionQueue()
    for partition, name in [(1, "b1"), (0, "a1"), (1, "b2"), (0, "a2")]:
        waiting.put(partition, name)
    assert waiting.take_oldest(3) == ["b1", "a1", "b2"]
    assert len(waiting) == 1 and waiting.of(0) == ["a2"] and waiting.of(1) == []


def test_a_retry_goes_ahead_of_everything_queued():
    waiting = PartitionQueue()
    waiting.put(0, "first")
    waiting.put(1, "second")
    waiting.put(1, "retry", first=True)
    assert waiting.peek_oldest() == "retry" and waiting.take_oldest() == ["retry", "first", "second"]


def test_dead_letter_marks_say_once_whether_an_offset_was_dead_lettered():
    marks = DeadLetterMarks({"r": 4})
    assert not marks.mark("r", 4) and not marks.mark("r", 2)   # from the ledger: done before
    assert marks.mark("r", 7) and not marks.mark("r", 7)
    assert marks.mark("s", 0) and marks.snapshot() == {"r": 7, "s": 0}
