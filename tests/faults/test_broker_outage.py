"""The only broker goes away while groups are open and comes back on the same address (a
restart, a crashed pod rescheduled): every group is published exactly once and nothing is lost,
by the same process.

librdkafka (2.16) can hang forever in send_offsets_to_transaction after its group coordinator's
broker went away and came back (librdkafka issues #5511, #5456). The stage sees every broker
down through its consumer, turns readiness false and starts a new producer (same
transactional.id) that fences the old one as soon as the broker answers; a call found stuck
after publish_stuck_ms is replaced the same way. This test allows no restart, watches /readyz
through the outage and prints the time from the broker's return to the last group published.
The outage longer than the consumer's session timeout, with the default settings, is
tests/faults/test_broker_restart.py.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest

from stage.brokers.kraft import KraftBroker, free_port, jars_available
from stage.finalize import ReassemblyConfig
from tests.faults.procs import StageProcess, SummaryWatcher, assert_exactly_once, read_outputs
from tests.integration.harness import Feeder, make_group, setup_topics, stage_config, unique_topics

N = 4
FINALIZE = ReassemblyConfig(router_replay=True, defer_routes=False)
TRANSACTION_TIMEOUT_MS = 60_000     # the last resort (exit 8) only past 75 s
PUBLISH_STUCK_MS = 10_000


class Readiness:
    """/readyz polled every 0.25 s on a thread: (seconds since start, status, body)."""

    def __init__(self, port: int) -> None:
        self.url, self.seen, self._stop = f"http://127.0.0.1:{port}/readyz", [], threading.Event()
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            try:
                with urllib.request.urlopen(self.url, timeout=1) as answer:
                    status, body = answer.status, answer.read().decode()
            except urllib.error.HTTPError as error:
                status, body = error.code, error.read().decode()
            except OSError:
                continue
            self.seen.append((time.monotonic() - self.started, status, body))

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)

pytestmark = pytest.mark.skipif(not jars_available(), reason="Kafka jars not found (make kafka-jars)")


@pytest.mark.parametrize("down_s", [3, 20])
def test_the_broker_restarting_under_open_groups_loses_and_duplicates_nothing(tmp_path, down_s):
    broker = KraftBroker(str(tmp_path / "broker"), heap="512m").start()
    topics = unique_topics()
    port = free_port()
    cfg = stage_config(broker.bootstrap, topics, finalize=FINALIZE, group_timeout_ms=60_000,
                       publish_linger_ms=100, poll_timeout_ms=20, metrics_port=port,
                       transaction_timeout_ms=TRANSACTION_TIMEOUT_MS, publish_stuck_ms=PUBLISH_STUCK_MS,
                       max_poll_interval_ms=300_000)
    setup_topics(cfg, partitions=2)
    before = [make_group(f"before-g{i}", N, seed=i) for i in range(6)]
    across = [make_group(f"across-g{i}", N, seed=50 + i) for i in range(6)]   # open over the outage
    after = [make_group(f"after-g{i}", N, seed=90 + i) for i in range(6)]
    stage = watcher = readiness = None
    try:
        stage = StageProcess(cfg, tmp_path, "stage")
        stage.wait_for(lambda: stage.assigned() == {0, 1}, 60, "stage assigned")
        readiness = Readiness(port)
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
        back = time.monotonic()

        feeder = Feeder(broker.bootstrap, topics)
        for spec in across:
            feeder.receipts(spec, spec.receipts[N // 2:])
        for spec in after:
            feeder.staged(spec)
            feeder.receipts(spec)
        feeder.flush()
        watcher = SummaryWatcher(broker.bootstrap, topics.finalized_groups)
        everything = before + across + after
        watcher.wait_for([g.group_id for g in everything], 180, procs=[stage], what="every group")
        recovered_s = time.monotonic() - back
        assert stage.alive(), f"the stage exited (rc {stage.returncode}) instead of recovering\n{stage.tail()}"
        stuck = [body for _t, status, body in readiness.seen if status == 503 and
                 ("publication stuck" in body or "brokers unreachable" in body)]
        hung = "publication stuck in" in stage.log()
        assert stuck and "new producer ready" in stage.log(), stage.tail(60)   # said, and replaced
        assert readiness.seen and readiness.seen[-1][1] == 200, readiness.seen[-5:]
        print(f"down {down_s}s: librdkafka {'hung' if hung else 'did not hang'}; every group published "
              f"{recovered_s:.1f}s after the broker came back; /readyz said {stuck[:1]}")
        assert stage.terminate(45) == 0, stage.tail()
        assert_exactly_once(read_outputs(broker.bootstrap, topics), everything, FINALIZE, N)
    except BaseException:
        if stage is not None:
            print(stage.tail(80))
        print(broker.log_tail(60))
        raise
    finally:
        if readiness is not None:
            readiness.close()
        if watcher is not None:
            watcher.close()
        if stage is not None:
            stage.close()
        broker.stop()
