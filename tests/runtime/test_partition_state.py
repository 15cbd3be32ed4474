"""Partitions (the assigned partitions' states) without a broker: dropping one forgets it in
every registered service, results match a partition only by its current epoch, and queues are
taken across partitions in the order they were filled."""

from stage.runtime.partition import Partitions
from stage.runtime.pauses import LOADING, PauseSet


def test_dropping_a_partition_forgets_it_everywhere_and_only_it():
    parts, forgotten = Partitions(), []
    parts.on_drop(forgotten.append)
    a, b = parts.add(0), parts.add(1)
    a.done.append((parts.stamp(), "out-a"))
    b.done.append((parts.stamp(), "out-b"))
    parts.drop({0})
    assert parts.numbers() == [1] and parts.get(0) is None and forgotten == [{0}]
    assert parts.items("done") == ["out-b"]


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
    parts = Partitions()
    a, b = parts.add(0), parts.add(1)
    for state, name in [(b, "b1"), (a, "a1"), (b, "b2"), (a, "a2")]:
        state.waiting.append((parts.stamp(), name))
    assert parts.take_oldest("waiting", 3) == ["b1", "a1", "b2"]
    assert parts.queued("waiting") == 1 and a.waiting[0][1] == "a2" and not b.waiting


def test_the_pause_set_reads_the_partitions_own_reasons():
    parts, pauses = Partitions(), PauseSet(("r", "s"))
    state = parts.add(5)
    pauses.adopt(5, state.paused_for)
    pauses.hold(5, LOADING)
    assert state.paused_for == {LOADING} and pauses.paused(5)
    state.paused_for.discard(LOADING)
    assert not pauses.paused(5)
