"""Everything held for unpublished groups counts against max_buffered_bytes: back-pressure
pauses on buffered input plus working sets, outputs and the transaction in flight, and a group
starts finalizing only when its working set fits (one always may when nothing else runs).
No broker: the steps with fakes."""

from concurrent.futures import Future
from types import SimpleNamespace

from stage.config.model import StageConfig
from stage.runtime.backpressure import BackPressure
from stage.runtime.finalization import Finalization
from stage.runtime.memory import Holdings, working_set
from stage.runtime.partition import Partitions, output_bytes
from stage.runtime.pauses import BACKPRESSURE, PauseSet


class Stats:
    def __init__(self):
        self.gauges = {}

    def set(self, name, value):
        self.gauges[name] = value

    def inc(self, *args, **kwargs):
        pass

    def observe(self, *args):
        pass


class Workers:
    def __init__(self):
        self.submitted = []

    def submit(self, group, why, epoch):
        self.submitted.append(group.group_id)
        return Future()


def _group(group_id, nbytes, partition=0):
    return SimpleNamespace(group_id=group_id, partition=partition, nbytes=nbytes)


def test_outputs_and_the_flight_count_toward_the_cap_not_only_the_buffers():
    cfg = StageConfig(bootstrap_servers="x:1", max_buffered_bytes=1000)
    parts, pauses, stats = Partitions(), PauseSet(("r", "s")), Stats()
    parts.add(0)
    held = Holdings(buffered=300, finalizing=200, outputs=300, publishing=250)
    bp = BackPressure(cfg, partitions=parts, pauses=pauses, stats=stats, busy=lambda: True,
                      holdings=lambda: held)
    bp.apply()
    assert pauses.why(0) == {BACKPRESSURE}      # 300 buffered alone is under the cap; 1050 held is not
    assert stats.gauges["held_bytes"] == 1050 and stats.gauges["buffered_bytes"] == 300


def test_a_group_starts_finalizing_only_when_its_working_set_fits():
    parts, pool = Partitions(), Workers()
    state = parts.add(0)
    for name, size in [("big", 600), ("small", 100)]:
        state.waiting.append((parts.stamp(), (_group(name, size), "complete", state.epoch)))
    cap = working_set(600, "direct") - 1            # not enough for the oldest
    fin = Finalization(workers=pool, max_inflight=64, routes_mode="direct", partitions=parts,
                       pauses=PauseSet(("r", "s")), stats=Stats(), room=lambda: cap - fin.working_bytes)
    fin.inflight[(0, "other")] = Future()          # and something else is finalizing
    fin.submit()
    assert pool.submitted == []                    # waits: the order is kept, nothing overtakes
    del fin.inflight[(0, "other")]
    fin.submit()                                   # nothing else in progress: one may always start
    assert pool.submitted == ["big"] and fin.working_bytes == working_set(600, "direct")
    fin.submit()                                   # "small" waits until "big" frees its working set
    assert pool.submitted == ["big"]


def test_output_bytes_are_the_encoded_records_and_the_ledger_entry():
    out = SimpleNamespace(records=[("rows", b"x" * 10), ("summaries", b"y" * 5)], ledger_value=b"z" * 3)
    assert output_bytes(out) == 18
