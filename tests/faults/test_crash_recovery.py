"""kill -9 at each transaction point, on a real broker: the restarted stage publishes every group
exactly once (read_committed), nothing is lost, and rows equal the library's.

The first stage process runs with ``ROLLOUT_REASSEMBLER_FAULT=<point>:2`` (armed through
tests/faults/launch.py, see the xfail below) and SIGKILLs itself the second time it reaches
``<point>``: around or inside its second transaction, which holds the second wave. Input keeps arriving
while it is down; a second process with the same transactional.id fences it (aborting any open
transaction), reloads the ledger, re-reads from the committed offsets and finishes the job.
"""

from __future__ import annotations

import signal

import pytest

from stage.finalize import ReassemblyConfig
from tests.faults.protocols import PROTOCOLS
from tests.faults.procs import StageProcess, SummaryWatcher, assert_exactly_once, read_outputs
from tests.integration.harness import Feeder, make_group, setup_topics, stage_config, unique_topics

N = 4
WAVES = 3
PER_WAVE = 8
FINALIZE = ReassemblyConfig(router_replay=True, defer_routes=False)


def _feed(feeder: Feeder, groups) -> None:
    for spec in groups:
        feeder.staged(spec)
        feeder.receipts(spec)
    feeder.flush()


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("fault", ["before_begin:2", "after_produce:2", "before_commit:2", "after_commit:2"])
def test_kill_9_at_a_transaction_point_then_restart_publishes_every_group_exactly_once(request, tmp_path, fault,
                                                                                       protocol):
    # KIP-848: the restarted process is a new member (no static id): it gets the partitions
    # once the killed one's session (the brokers' 6 s) has expired
    kafka = request.getfixturevalue("kafka" if protocol == "classic" else "kip848_broker")
    topics = unique_topics()
    # A long group timeout: every group here is complete, so none may be published by deadline
    # (a restart must not turn a complete group into a partial one). A linger of a few hundred ms
    # makes each wave one transaction, so the crash lands between waves as intended.
    cfg = stage_config(kafka.bootstrap, topics, finalize=FINALIZE, group_timeout_ms=20_000,
                       publish_linger_ms=300, poll_timeout_ms=20, **PROTOCOLS[protocol])
    setup_topics(cfg, partitions=2)
    tag = fault.split(":")[0]
    waves = [[make_group(f"{tag}-w{w}-g{i}", N, seed=100 * w + i) for i in range(PER_WAVE)]
             for w in range(WAVES)]
    groups = [g for wave in waves for g in wave]
    feeder = Feeder(kafka.bootstrap, topics)
    watcher = SummaryWatcher(kafka.bootstrap, topics.finalized_groups)
    procs: list[StageProcess] = []
    try:
        first = StageProcess(cfg, tmp_path, "first", fault=fault)
        procs.append(first)
        first.wait_for(lambda: first.assigned() == {0, 1}, 60, "first process assigned")
        # Wave 0 goes through the first transaction(s); wave 1 reaches the fault point.
        _feed(feeder, waves[0])
        fed = 1
        try:
            watcher.wait_for([g.group_id for g in waves[0]], 60, procs=[first], what="wave 0")
        except AssertionError:
            if first.alive():
                raise
            # wave 0 took two transactions and the fault already fired: that is still a crash mid-run
        if first.alive():
            _feed(feeder, waves[1])
            fed = 2
        rc = first.wait_exit(60)
        assert rc == -signal.SIGKILL, f"the fault {fault} did not kill the first process\n{first.tail()}"
        watcher.poll(1.0)
        before_crash = set(watcher.seen)
        # The crash was mid-run: the first process had committed some groups, not all.
        assert before_crash and len(before_crash) < len(groups), sorted(before_crash)
        print(f"{fault}: first process killed after {len(before_crash)} committed groups, "
              f"{fed} wave(s) fed while it ran")
        # Input that arrives while the stage is down.
        for wave in waves[fed:]:
            _feed(feeder, wave)
        second = StageProcess(cfg, tmp_path, "second")
        procs.append(second)
        watcher.wait_for([g.group_id for g in groups], 120, procs=[second], what="every group after restart")
        assert second.terminate(45) == 0, second.tail()

        committed = read_outputs(kafka.bootstrap, topics, "read_committed")
        assert_exactly_once(committed, groups, FINALIZE, N)
        uncommitted = read_outputs(kafka.bootstrap, topics, "read_uncommitted")
        extra = len(uncommitted.summaries) - len(committed.summaries)
        print(f"{fault}: {extra} aborted GroupSummary record(s) visible to read_uncommitted")
        if tag in ("after_produce", "before_commit"):
            # The killed transaction's records are in the log (aborted): a read_uncommitted reader
            # sees them, the read_committed one above did not.
            assert extra > 0, "no aborted records found: the crash did not interrupt a transaction"
            assert len(uncommitted.rows) > len(committed.rows)
            # ...and they are earlier attempts at the same groups, nothing foreign.
            assert {s["group_id"] for s in uncommitted.summaries} == {g.group_id for g in groups}
        else:
            # The crash fell outside any transaction: nothing was ever aborted.
            assert extra == 0 and len(uncommitted.rows) == len(committed.rows)
    except BaseException:
        for proc in procs:
            print(proc.tail(80))
        raise
    finally:
        for proc in procs:
            proc.close()
        watcher.close()


class FaultEnvRejected(AssertionError):
    """The CLI refused ROLLOUT_REASSEMBLER_FAULT as an unknown setting (the bug below)."""


# Regression: load_config used to reject ROLLOUT_REASSEMBLER_FAULT as an unknown setting.
def test_fault_env_does_not_stop_the_cli_from_starting(kafka, tmp_path):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, finalize=FINALIZE)
    setup_topics(cfg, partitions=2)
    proc = StageProcess(cfg, tmp_path, "cli", fault="after_commit:1000000", fault_env_direct=True)
    try:
        try:
            proc.wait_for(lambda: "stage started" in proc.log(), 60, "the stage to start")
        except AssertionError as error:
            if "unknown setting ROLLOUT_REASSEMBLER_FAULT" in proc.log():
                raise FaultEnvRejected(str(error)) from error
            raise
        assert proc.terminate(45) == 0, proc.tail()
    finally:
        proc.close()
