"""A rolling restart of a 3-broker cluster (each node stopped, then started again, one after
the other) under a running stage: every group exactly once, across any stage restarts.

Restarting the broker that coordinates the stage's consumer group makes librdkafka 2.16 hang
in send_offsets_to_transaction (librdkafka #5511): the stage exits 8 past its transaction
timeout and this test, as the supervisor, restarts it. Measured 2026-12-01 (two runs): one and
two stage restarts per rolling restart of three brokers.

Opt-in (about 3 minutes and three JVMs): SLOW_FAULT_TESTS=1.
"""

from __future__ import annotations

import os
import time

import pytest
from confluent_kafka.admin import AdminClient

from stage.finalize import ReassemblyConfig
from stage.brokers.kraft import KraftCluster, jars_available
from stage.runtime.topics import create_topics
from tests.faults.procs import SummaryWatcher, Supervisor, assert_exactly_once, read_outputs
from tests.integration.harness import Feeder, make_group, stage_config, unique_topics

N = 4
FINALIZE = ReassemblyConfig(router_replay=True, defer_routes=False)

pytestmark = [
    pytest.mark.skipif(not jars_available(), reason="Kafka jars not found (make kafka-jars)"),
    pytest.mark.skipif(os.environ.get("SLOW_FAULT_TESTS") != "1",
                       reason="opt-in: SLOW_FAULT_TESTS=1 (about 3 minutes)"),
]


def test_a_rolling_restart_of_every_broker_loses_and_duplicates_nothing(tmp_path):
    cluster = KraftCluster(3).start()
    supervisor = None
    watcher = None
    try:
        topics = unique_topics()
        cfg = stage_config(cluster.bootstrap, topics, finalize=FINALIZE, group_timeout_ms=60_000,
                           publish_linger_ms=100, transaction_timeout_ms=10_000)
        create_topics(AdminClient({"bootstrap.servers": cluster.bootstrap}), cfg, partitions=2, replication=3)
        supervisor = Supervisor(cfg, tmp_path)
        stage = supervisor.stage
        stage.wait_for(lambda: stage.assigned() == {0, 1}, 60, "stage assigned")
        feeder = Feeder(cluster.bootstrap, topics)
        waves = [[make_group(f"w{w}-g{i}", N, seed=10 * w + i) for i in range(4)] for w in range(5)]

        def feed(wave):
            for spec in wave:
                feeder.staged(spec)
                feeder.receipts(spec)
            feeder.flush()

        watcher = SummaryWatcher(cluster.bootstrap, topics.finalized_groups)
        feed(waves[0])
        supervisor.wait_for(watcher, [g.group_id for g in waves[0]], 60)
        for wave, node in zip(waves[1:4], cluster.nodes):
            node.stop()                      # controlled shutdown, as a rolling restart does
            feed(wave)
            time.sleep(3)
            node.start()
            cluster.wait_brokers(3, 90)
            supervisor.wait_for(watcher, [g.group_id for g in wave], 120)
        feed(waves[4])
        everything = [g for wave in waves for g in wave]
        supervisor.wait_for(watcher, [g.group_id for g in everything], 120)
        assert supervisor.stage.terminate(45) == 0, supervisor.stage.tail()
        print(f"rolling restart: {len(supervisor.procs)} stage process(es)")
        assert_exactly_once(read_outputs(cluster.bootstrap, topics), everything, FINALIZE, N)
    except BaseException:
        for proc in supervisor.procs if supervisor else ():
            print(proc.tail(60))
        raise
    finally:
        if watcher is not None:
            watcher.close()
        if supervisor is not None:
            supervisor.close()
        cluster.stop()
