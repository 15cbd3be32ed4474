"""Everything held for unpublished groups counts against max_buffered_bytes: back-pressure
pauses on buffered input plus working sets, outputs and the transaction in flight, and a group
starts finalizing only when its working set fits (one always may when nothing else runs).
No broker: the steps with fakes."""

from concurrent.futures import Future
from types import SimpleNamespace

from stage.config.model import StageConfig
from stage.runtime.state.memory import Holdings, working_set
from stage.runtime.state.partition import Partitions
from stage.runtime.steps.backpressure import BackPressure
from stage.runtime.steps.deadlines import Ready
from stage.runtime.steps.finalization import Finalization
from stage.runtime.steps.outcomes import Budget
from stage.runtime.steps.publication import output_bytes


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
    held = Holdings(buffered=300, finalizing=200, outputs=300, publishing=250)
    bp = BackPressure(cfg)
    bp.apply(held, open_groups=1, busy=True)
    assert bp.paused                            # 300 buffered alone is under the cap; 1050 held is not
    assert held.total == 1050
    between = int(1000 * (1 + cfg.resume_fraction) / 2)
    bp.apply(Holdings(buffered=between), open_groups=1, busy=True)
    assert bp.paused                            # under the cap but above resume_fraction of it
    bp.apply(Holdings(buffered=int(1000 * cfg.resume_fraction) - 1), open_groups=1, busy=True)
    assert not bp.paused                        # drained


def test_back_pressure_never_pauses_a_buffer_that_waits_only_for_input():
    bp = BackPressure(StageConfig(bootstrap_servers="x:1", max_buffered_bytes=1000))
    bp.apply(Holdings(buffered=5000), open_groups=3, busy=False)
    assert not bp.paused                        # nothing finalizing or publishing: keep reading


def test_a_group_starts_finalizing_only_when_its_working_set_fits():
    parts, pool = Partitions(), Workers()
    state = parts.add(0)
    cap = working_set(600, "direct") - 1            # not enough for the oldest
    fin = Finalization(workers=pool, max_inflight=64, routes_mode="direct", partitions=parts,
                       stats=Stats())
    fin.offer([Ready(_group(name, size), "complete", state.epoch) for name, size in [("big", 600), ("small", 100)]])

    def budget():
        return Budget(room=cap - fin.working_bytes)

    fin.inflight[(0, "other")] = Future()          # and something else is finalizing
    fin.submit(budget())
    assert pool.submitted == []                    # waits: the order is kept, nothing overtakes
    del fin.inflight[(0, "other")]
    fin.submit(budget())                           # nothing else in progress: one may always start
    assert pool.submitted == ["big"] and fin.working_bytes == working_set(600, "direct")
    fin.submit(budget())                           # "small" waits until "big" frees its working set
    assert pool.submitted == ["big"]


def test_output_bytes_are_the_encoded_records_and_the_ledger_entry():
    out = SimpleNamespace(records=[("rows", b"x" * 10), ("summaries", b"y" * 5)], ledger_value=b"z" * 3)
    assert output_bytes(out) == 18
