"""Rebalances on a real broker with two stage processes in one consumer group (4 partitions):
A runs alone, B joins mid-run, A leaves mid-run (SIGTERM: graceful shutdown and cooperative
revoke) or is lost (SIGKILL: its partitions move to B once its session times out), then B stops,
under both consumer group protocols (classic cooperative-sticky, and KIP-848 on a broker of its own).
Input trickles in throughout, each group's records spread out, so every membership change lands
on half-joined groups. Every group is published exactly once (read_committed), none is lost, and
rows equal the library's."""

from __future__ import annotations

import signal
import time

import pytest

from stage.finalize import ReassemblyConfig
from tests.faults.protocols import PROTOCOLS
from tests.faults.procs import StageProcess, SummaryWatcher, Trickle, assert_exactly_once, read_outputs
from tests.integration.harness import make_group, replace, setup_topics, stage_config, unique_topics

N = 4
PARTITIONS = 4
FINALIZE = ReassemblyConfig(router_replay=True, defer_routes=False)
ALL = set(range(PARTITIONS))


@pytest.mark.parametrize("leave", ["sigterm", "sigkill", "sigkill_in_txn"])
def test_join_and_leave_mid_run_publishes_every_group_exactly_once(kafka, tmp_path, leave):
    join_and_leave(kafka, tmp_path, leave)


@pytest.mark.parametrize("leave", ["sigterm", "sigkill", "sigkill_in_txn"])
def test_join_and_leave_under_the_kip848_protocol_publishes_every_group_exactly_once(
        kip848_broker, tmp_path, leave):
    join_and_leave(kip848_broker, tmp_path, leave, **PROTOCOLS["kip848"])


def join_and_leave(kafka, tmp_path, leave, **protocol):
    topics = unique_topics()
    # group_timeout_ms well above the takeover time (session.timeout.ms 6000 + rebalance), so no
    # group is published by deadline with part of its input still unread.
    # sigkill_in_txn: A dies inside a transaction that holds output records AND input offsets
    # (the before_commit point), while B is a member with another transactional.id, so nothing
    # fences A's transaction: the broker aborts it at transaction.timeout.ms (kept short here).
    in_txn = leave == "sigkill_in_txn"
    base = stage_config(kafka.bootstrap, topics, finalize=FINALIZE, group_timeout_ms=20_000,
                        publish_linger_ms=50, poll_timeout_ms=20, **protocol,
                        **({"transaction_timeout_ms": 10_000} if in_txn else {}))
    setup_topics(base, partitions=PARTITIONS)
    cfg_a = replace(base, transactional_id=f"{base.transactional_id}-a")
    cfg_b = replace(base, transactional_id=f"{base.transactional_id}-b")
    sizes = (4, 8, 8, 4)   # 24 groups
    waves = [[make_group(f"{leave}-w{w}-g{i}", N, seed=100 * w + i) for i in range(size)]
             for w, size in enumerate(sizes)]
    groups = [g for wave in waves for g in wave]
    ids = lambda wave: [g.group_id for g in wave]  # noqa: E731
    trickle = Trickle(kafka.bootstrap, topics, pace_s=0.25)
    watcher = SummaryWatcher(kafka.bootstrap, topics.finalized_groups)
    procs: list[StageProcess] = []
    try:
        arm = tmp_path / "arm-A"
        a = StageProcess(cfg_a, tmp_path, "A", **({"fault": "before_commit:1", "arm_file": arm} if in_txn else {}))
        procs.append(a)
        a.wait_for(lambda: a.assigned() == ALL, 60, "A assigned every partition")
        trickle.add(waves[0])
        trickle.drain(30)
        watcher.wait_for(ids(waves[0]), 60, procs=[a], what="wave 0 (A alone)")

        # B joins while input is flowing: A gives up half its partitions (cooperative revoke).
        trickle.add(waves[1])
        b = StageProcess(cfg_b, tmp_path, "B")
        procs.append(b)
        b.wait_for(lambda: b.assigned(), 60, "B assigned some partitions (join)")
        trickle.drain(30)
        watcher.wait_for(ids(waves[1]), 60, procs=[a, b], what="wave 1 (B joining)")
        b_after_join = b.assigned()
        assert b_after_join and b_after_join != ALL, b_after_join

        # A leaves (or is lost) while input is flowing.
        trickle.add(waves[2])
        time.sleep(0.8)   # a few groups of this wave are fed, some only in part
        if leave == "sigterm":
            a.signal(signal.SIGTERM)
            assert a.wait_exit(60) == 0, f"A did not shut down cleanly\n{a.tail()}"
        elif in_txn:
            arm.touch()   # A SIGKILLs itself inside its next transaction
            assert a.wait_exit(30) == -signal.SIGKILL, f"A did not die at the fault point\n{a.tail()}"
        else:
            a.kill()
            assert a.returncode == -signal.SIGKILL
        # A's partitions move to B: at once on a clean leave, after session.timeout.ms if lost.
        b.wait_for(lambda: b.assigned() == ALL, 60, "B took over A's partitions")
        trickle.drain(30)
        watcher.wait_for(ids(waves[2]), 90, procs=[b], what="wave 2 (A leaving)")

        trickle.add(waves[3])
        trickle.drain(30)
        watcher.wait_for(ids(waves[3]), 60, procs=[b], what="wave 3 (B alone)")
        assert b.terminate(60) == 0, f"B did not shut down cleanly\n{b.tail()}"
        print(f"{leave}: A assignments {a.assignments()}, B assignments {b.assignments()}")

        committed = read_outputs(kafka.bootstrap, topics, "read_committed")
        assert_exactly_once(committed, groups, FINALIZE, N)
        if in_txn:
            # A's killed transaction is in the log, aborted: visible only to read_uncommitted.
            uncommitted = read_outputs(kafka.bootstrap, topics, "read_uncommitted")
            assert len(uncommitted.summaries) > len(committed.summaries)
    except BaseException:
        for proc in procs:
            print(proc.tail(80))
        raise
    finally:
        trickle.close()
        for proc in procs:
            proc.close()
        watcher.close()


class SurvivorCrashedOnUnstableOffsets(AssertionError):
    """B died of the committed-offsets timeout in its assign callback (the bug below)."""


# Regression: the assign callback used to read committed offsets with a 30 s timeout and died
# of _TIMED_OUT while a killed member's transaction still held them (UNSTABLE_OFFSET_COMMIT).
def test_survivor_waits_out_a_zombie_transaction_longer_than_the_offset_fetch_timeout(kafka, tmp_path):
    topics = unique_topics()
    base = stage_config(kafka.bootstrap, topics, finalize=FINALIZE, group_timeout_ms=20_000,
                        publish_linger_ms=50, poll_timeout_ms=20, transaction_timeout_ms=60_000)
    setup_topics(base, partitions=PARTITIONS)
    groups = [make_group(f"zombie-g{i}", N, seed=i) for i in range(8)]
    trickle = Trickle(kafka.bootstrap, topics, pace_s=0.25)
    watcher = SummaryWatcher(kafka.bootstrap, topics.finalized_groups)
    arm = tmp_path / "arm-A"
    procs: list[StageProcess] = []
    try:
        a = StageProcess(replace(base, transactional_id=f"{base.transactional_id}-a"), tmp_path, "A",
                         fault="before_commit:1", arm_file=arm)
        procs.append(a)
        a.wait_for(lambda: a.assigned() == ALL, 60, "A assigned every partition")
        b = StageProcess(replace(base, transactional_id=f"{base.transactional_id}-b"), tmp_path, "B")
        procs.append(b)
        b.wait_for(lambda: b.assigned(), 60, "B assigned some partitions")
        arm.touch()   # A dies inside its first transaction (output records and offsets sent)
        trickle.add(groups)
        assert a.wait_exit(30) == -signal.SIGKILL, f"A did not die at the fault point\n{a.tail()}"
        try:
            b.wait_for(lambda: b.assigned() == ALL, 100, "B took over A's partitions")
            trickle.drain(30)
            watcher.wait_for([g.group_id for g in groups], 90, procs=[b], what="every group")
        except AssertionError as error:
            if not b.alive() and "Failed to get committed offsets" in b.log():
                raise SurvivorCrashedOnUnstableOffsets(str(error)) from error
            raise
        assert b.terminate(60) == 0, b.tail()
        assert_exactly_once(read_outputs(kafka.bootstrap, topics, "read_committed"), groups, FINALIZE, N)
    except BaseException:
        for proc in procs:
            print(proc.tail(40))
        raise
    finally:
        trickle.close()
        for proc in procs:
            proc.close()
        watcher.close()
