"""Failures an operator must act on end with a readable message and a distinct exit code
(docs/operations.md, "Exit codes"), never a raw traceback: an unreachable broker, a fenced replica, and
partitions added to an input topic while the stage runs."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request

import pytest
from confluent_kafka.admin import AdminClient, NewPartitions

from stage.brokers.kraft import free_port
from stage.runtime.exits import EXIT_FENCED, EXIT_KAFKA_UNREACHABLE, EXIT_TOPOLOGY
from tests.faults.procs import StageProcess, SummaryWatcher
from tests.integration.harness import Feeder, make_group, replace, setup_topics, stage_config, unique_topics


def _no_traceback(proc: StageProcess) -> None:
    assert "Traceback" not in proc.log(), proc.tail(80)


def test_an_unreachable_broker_exits_4_with_a_message_after_startup_broker_wait_ms(tmp_path):
    cfg = stage_config("127.0.0.1:9", unique_topics(), startup_broker_wait_ms=5000)
    proc = StageProcess(cfg, tmp_path, "unreachable")
    try:
        assert proc.wait_exit(60) == EXIT_KAFKA_UNREACHABLE, proc.tail()
        assert "no Kafka broker answered at 127.0.0.1:9" in proc.log()
        _no_traceback(proc)
    finally:
        proc.close()


def test_by_default_a_stage_started_with_no_broker_answering_waits_says_why_and_stops_on_sigterm(tmp_path):
    """A replica restarted while a network partition lasts starts once it heals instead of
    exiting 4 and restart-looping (with a container runtime's growing back-off) meanwhile."""
    port = free_port()
    cfg = stage_config("127.0.0.1:9", unique_topics(), metrics_port=port)
    proc = StageProcess(cfg, tmp_path, "waiting")
    try:
        deadline = time.monotonic() + 60
        while "Still trying" not in proc.log():
            assert proc.alive(), proc.tail()
            assert time.monotonic() < deadline, proc.tail()
            time.sleep(0.5)
        assert "no Kafka broker answered at 127.0.0.1:9" in proc.log() and proc.alive()
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5)
        assert answer.value.code == 503
        proc.signal(signal.SIGTERM)
        assert proc.wait_exit(30) == 0, proc.tail()
        _no_traceback(proc)
    finally:
        proc.close()


def test_a_second_process_with_the_same_transactional_id_fences_the_first(kafka, tmp_path):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    setup_topics(cfg, partitions=2)
    feeder = Feeder(kafka.bootstrap, topics)
    watcher = SummaryWatcher(kafka.bootstrap, topics.finalized_groups)
    first = StageProcess(cfg, tmp_path, "first")
    # Another consumer group, same transactional id: the broker fences the older producer.
    second = None
    try:
        first.wait_for(lambda: "partition 1 ready" in first.log() and "partition 0 ready" in first.log(),
                       60, "first ready")
        second = StageProcess(replace(cfg, group_id=cfg.group_id + "-twin"), tmp_path, "second")
        second.wait_for(lambda: "stage started" in second.log(), 60, "second started")
        spec = make_group("fenced", 2, seed=140, routes=None)
        feeder.staged(spec)
        feeder.receipts(spec)
        feeder.flush()
        assert first.wait_exit(60) == EXIT_FENCED, first.tail()
        log = first.log()
        assert "this replica was fenced" in log and repr(cfg.transactional_id) in log
        _no_traceback(first)
        watcher.wait_for(["fenced"], 60, procs=[second], what="the survivor publishes")
    finally:
        first.close()
        if second is not None:
            second.close()
        watcher.close()


def test_partitions_added_while_running_stop_the_stage_with_exit_5(kafka, tmp_path):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    setup_topics(cfg, partitions=2)
    proc = StageProcess(cfg, tmp_path, "repartitioned")
    try:
        proc.wait_for(lambda: "partition 0 ready" in proc.log(), 60, "ready")
        admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
        for future in admin.create_partitions([NewPartitions(topics.staged_calls, 3)]).values():
            future.result()
        started = time.monotonic()
        assert proc.wait_exit(90) == EXIT_TOPOLOGY, proc.tail()
        assert time.monotonic() - started < 75
        assert f"topic {topics.staged_calls} now has 3 partitions, not 2" in proc.log()
        _no_traceback(proc)
    finally:
        proc.close()
