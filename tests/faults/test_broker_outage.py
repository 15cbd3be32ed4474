"""The only broker goes away while groups are open and comes back on the same address (a
restart, a crashed pod rescheduled): every group is published exactly once and nothing is lost.

librdkafka (2.16) can hang forever in send_offsets_to_transaction after its group coordinator's
broker went away and came back (librdkafka issues #5511, #5456). The stage then stops with
exit 8 once the transaction is past its timeout, instead of hanging; its supervisor restarts it.
This test plays the supervisor: a process that exits 8 with that message is restarted once.
"""

from __future__ import annotations

import time

import pytest

from stage.finalize import ReassemblyConfig
from stage.kraft import KraftBroker, jars_available
from stage.runtime.exits import EXIT_KAFKA_FATAL
from tests.faults.procs import StageProcess, SummaryWatcher, assert_exactly_once, read_outputs
from tests.integration.harness import Feeder, make_group, setup_topics, stage_config, unique_topics

N = 4
FINALIZE = ReassemblyConfig(router_replay=True, defer_routes=False)
TRANSACTION_TIMEOUT_MS = 10_000     # a stuck publication is given up 25 s after it began

pytestmark = pytest.mark.skipif(not jars_available(), reason="Kafka jars not found (make kafka-jars)")


def _wait_restarting(watcher, wanted, stage, cfg, tmp_path, procs, timeout: float):
    """Wait for every group; a stage that stopped because a publication hung is restarted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        watcher.poll()
        if set(wanted) <= set(watcher.seen):
            return stage
        if not stage.alive():
            assert stage.returncode == EXIT_KAFKA_FATAL and "has not completed in" in stage.log(), \
                f"{stage.name} exited (rc {stage.returncode})\n{stage.tail()}"
            assert len(procs) < 3, "the restarted stage hung again"
            print(f"{stage.name} stopped on a stuck publication (exit 8); restarting it")
            stage = StageProcess(cfg, tmp_path, f"restart{len(procs)}")
            procs.append(stage)
    raise AssertionError(f"timed out; missing {sorted(set(wanted) - set(watcher.seen))}\n{stage.tail()}")


@pytest.mark.parametrize("down_s", [3, 20])
def test_the_broker_restarting_under_open_groups_loses_and_duplicates_nothing(tmp_path, down_s):
    broker = KraftBroker(str(tmp_path / "broker"), heap="512m").start()
    topics = unique_topics()
    cfg = stage_config(broker.bootstrap, topics, finalize=FINALIZE, group_timeout_ms=60_000,
                       publish_linger_ms=100, poll_timeout_ms=20,
                       transaction_timeout_ms=TRANSACTION_TIMEOUT_MS)
    setup_topics(cfg, partitions=2)
    before = [make_group(f"before-g{i}", N, seed=i) for i in range(6)]
    across = [make_group(f"across-g{i}", N, seed=50 + i) for i in range(6)]   # open over the outage
    after = [make_group(f"after-g{i}", N, seed=90 + i) for i in range(6)]
    procs: list[StageProcess] = []
    watcher = None
    try:
        stage = StageProcess(cfg, tmp_path, "stage")
        procs.append(stage)
        stage.wait_for(lambda: stage.assigned() == {0, 1}, 60, "stage assigned")
        feeder = Feeder(broker.bootstrap, topics)
        for spec in before:
            feeder.staged(spec)
            feeder.receipts(spec)
        for spec in across:                      # staged calls and half the receipts only
            feeder.staged(spec)
            feeder.receipts(spec, spec.receipts[: N // 2])
        feeder.flush()
        watcher = SummaryWatcher(broker.bootstrap, topics.finalized_groups)
        watcher.wait_for([g.group_id for g in before], 60, procs=[stage], what="groups before the outage")
        watcher.close()
        watcher = None

        broker.kill()                            # kill -9: no controlled shutdown
        time.sleep(down_s)
        broker.start()

        feeder = Feeder(broker.bootstrap, topics)
        for spec in across:
            feeder.receipts(spec, spec.receipts[N // 2:])
        for spec in after:
            feeder.staged(spec)
            feeder.receipts(spec)
        feeder.flush()
        watcher = SummaryWatcher(broker.bootstrap, topics.finalized_groups)
        everything = before + across + after
        stage = _wait_restarting(watcher, [g.group_id for g in everything], stage, cfg, tmp_path, procs, 240)
        assert stage.terminate(45) == 0, stage.tail()
        print(f"down {down_s}s: {len(procs)} stage process(es)")
        assert_exactly_once(read_outputs(broker.bootstrap, topics), everything, FINALIZE, N)
    except BaseException:
        for proc in procs:
            print(proc.tail(80))
        print(broker.log_tail(60))
        raise
    finally:
        if watcher is not None:
            watcher.close()
        for proc in procs:
            proc.close()
        broker.stop()
