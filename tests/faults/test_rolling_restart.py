"""A graceful rolling restart of a 3-broker cluster (each node SIGTERMed and started again in
turn, the next once nothing is under-replicated) under a running stage: every group exactly
once, and the same stage process throughout.

Restarting the broker that coordinates the stage's consumer group can make librdkafka 2.16 hang
in send_offsets_to_transaction (librdkafka #5511); the stage replaces the stuck producer in
process (stage.runtime.steps.publication). Every Kafka upgrade or config change is such a restart, so
this runs in CI (about 3 minutes, three JVMs), under both consumer group protocols
(tests/faults/protocols.py).
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import AdminClient

from stage.finalize import ReassemblyConfig
from stage.brokers.kraft import KraftCluster, jars_available
from stage.runtime.kafka.topics import create_topics
from tests.faults.protocols import KIP848_BROKER, PROTOCOLS
from tests.faults.procs import StageProcess, SummaryWatcher, assert_exactly_once, read_outputs
from tests.integration.harness import Feeder, make_group, stage_config, unique_topics

N = 4
FINALIZE = ReassemblyConfig(router_replay=True, defer_routes=False)

pytestmark = [
    pytest.mark.skipif(not jars_available(), reason="Kafka jars not found (make kafka-jars)"),
    pytest.mark.slow,
]


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_a_rolling_restart_of_every_broker_loses_and_duplicates_nothing(tmp_path, protocol):
    cluster = KraftCluster(3, props=KIP848_BROKER).start()
    stage = watcher = None
    try:
        topics = unique_topics()
        cfg = stage_config(cluster.bootstrap, topics, finalize=FINALIZE, group_timeout_ms=60_000,
                           publish_linger_ms=100, publish_stuck_ms=10_000, **PROTOCOLS[protocol])
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        create_topics(admin, cfg, partitions=2, replication=3)
        del admin                            # no admin client lives through the restarts
        stage = StageProcess(cfg, tmp_path, "stage")
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
        watcher.wait_for([g.group_id for g in waves[0]], 60, procs=[stage])
        for wave, node in zip(waves[1:4], cluster.nodes):
            node.stop()                      # SIGTERM: a controlled shutdown
            feed(wave)
            time.sleep(3)
            node.start()
            cluster.wait_brokers(3, 90)
            cluster.wait_in_sync(120)         # the next broker only once nothing is under-replicated
            started = time.monotonic()
            watcher.wait_for([g.group_id for g in wave], 120, procs=[stage], what=f"wave after node {node.node_id}")
            print(f"node {node.node_id} restarted: its wave published {time.monotonic() - started:.1f}s "
                  "after the cluster was in sync again")
        feed(waves[4])
        everything = [g for wave in waves for g in wave]
        watcher.wait_for([g.group_id for g in everything], 120, procs=[stage])
        log = stage.log()
        print(f"rolling restart: one stage process, {log.count('new producer ready')} stuck "
              "publication(s) recovered in process")
        assert stage.terminate(45) == 0, stage.tail()
        assert_exactly_once(read_outputs(cluster.bootstrap, topics), everything, FINALIZE, N)
    except BaseException:
        if stage is not None:
            print(stage.tail(60))
        raise
    finally:
        if watcher is not None:
            watcher.close()
        if stage is not None:
            stage.close()
        cluster.discard()
