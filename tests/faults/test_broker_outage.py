"""The only broker goes away while groups are open and comes back on the same address (a
restart, a crashed pod rescheduled): every group is published exactly once and nothing is lost.

librdkafka (2.16) can hang forever in send_offsets_to_transaction after its group coordinator's
broker went away and came back (librdkafka issues #5511, #5456). The stage then stops with
exit 8 once the transaction is past its timeout, instead of hanging; its supervisor restarts it.
This test plays the supervisor (tests/faults/procs.py, Supervisor): a process that exits 8 with
that message is started again.
"""

from __future__ import annotations

import time

import pytest

from stage.finalize import ReassemblyConfig
from stage.brokers.kraft import KraftBroker, jars_available
from tests.faults.procs import SummaryWatcher, Supervisor, assert_exactly_once, read_outputs
from tests.integration.harness import Feeder, make_group, setup_topics, stage_config, unique_topics

N = 4
FINALIZE = ReassemblyConfig(router_replay=True, defer_routes=False)
TRANSACTION_TIMEOUT_MS = 10_000     # a stuck publication is given up 25 s after it began

pytestmark = pytest.mark.skipif(not jars_available(), reason="Kafka jars not found (make kafka-jars)")


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
    supervisor = None
    watcher = None
    try:
        supervisor = Supervisor(cfg, tmp_path, max_restarts=2)
        stage = supervisor.stage
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
        supervisor.wait_for(watcher, [g.group_id for g in everything], 240)
        assert supervisor.stage.terminate(45) == 0, supervisor.stage.tail()
        print(f"down {down_s}s: {len(supervisor.procs)} stage process(es)")
        assert_exactly_once(read_outputs(broker.bootstrap, topics), everything, FINALIZE, N)
    except BaseException:
        for proc in supervisor.procs if supervisor else ():
            print(proc.tail(80))
        print(broker.log_tail(60))
        raise
    finally:
        if watcher is not None:
            watcher.close()
        if supervisor is not None:
            supervisor.close()
        broker.stop()
