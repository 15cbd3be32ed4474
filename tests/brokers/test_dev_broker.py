"""``rollout-reassembler broker``: a real Kafka for development, as a user runs it (a process,
stopped with SIGTERM), and the messages it gives when something it needs is missing."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.brokers.dev import java_major
from stage.brokers.kraft import free_port, jars_available
from stage.wire import TopicNames

ROOT = Path(__file__).resolve().parents[2]
QUIET = logging.getLogger("dev-broker-test")    # no librdkafka connection noise once it stops
QUIET.setLevel(logging.CRITICAL)
needs_jars = pytest.mark.skipif(not jars_available(), reason="no Kafka jars (make kafka-jars) or no java")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_REASSEMBLER_")
           or k == "ROLLOUT_REASSEMBLER_KAFKA_JARS"}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class BrokerCommand:
    """``python -m stage broker ARGS`` in the background, its output collected line by line."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "stage", "broker", *args], cwd=ROOT,
                                     env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []

    def until(self, prefix: str, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"exited (rc {self.proc.wait()}) before {prefix!r}:\n" + "".join(self.lines))
            self.lines.append(line)
            if line.startswith(prefix):
                return line.strip()
        raise AssertionError(f"no {prefix!r} line after {timeout}s:\n" + "".join(self.lines))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(60)
        self.lines += self.proc.stdout.readlines()
        return rc


@needs_jars
def test_broker_serves_kafka_with_the_stage_topics_until_sigterm_and_keeps_its_data(tmp_path):
    port, controller = free_port(), free_port()
    topics = TopicNames(**{k: f"dev.{v}" for k, v in TopicNames().all().items()})
    config = tmp_path / "stage.yaml"
    config.write_text(yaml.safe_dump({"topics": topics.all()}))
    data = tmp_path / "kafka-data"
    args = ("--port", str(port), "--controller-port", str(controller), "--data-dir", str(data),
            "--heap", "512m")
    broker = BrokerCommand(*args, "--create-topics", "--partitions", "3", "--config", str(config))
    try:
        assert broker.until("bootstrap: ") == f"bootstrap: 127.0.0.1:{port}"
        created = broker.until("topics: ")
        assert "8 created, 3 partitions each, replication 1, min.insync.replicas 1" in created
        broker.until("ready: ")
        bootstrap = f"127.0.0.1:{port}"
        metadata = AdminClient({"bootstrap.servers": bootstrap}, logger=QUIET).list_topics(timeout=10)
        for name in topics.all().values():
            assert len(metadata.topics[name].partitions) == 3
            assert {len(p.replicas) for p in metadata.topics[name].partitions.values()} == {1}
        producer = Producer({"bootstrap.servers": bootstrap}, logger=QUIET)   # it is a real broker:
        producer.produce(topics.receipts, key=b"k", value=b"kept", partition=0)
        assert producer.flush(30) == 0
        del producer
    finally:
        rc = broker.stop()
    assert rc == 0, "".join(broker.lines)
    assert "broker stopped" in broker.lines[-1]
    with pytest.raises(Exception):      # the JVM is gone: nothing answers on the port any more
        AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"}, logger=QUIET).list_topics(timeout=3)

    again = BrokerCommand(*args)                         # the same data directory: reused
    try:
        assert "(reused)" in again.until("data: ")
        again.until("ready: ")
        consumer = Consumer({"bootstrap.servers": f"127.0.0.1:{port}", "group.id": "dev-test",
                             "enable.partition.eof": False}, logger=QUIET)
        consumer.assign([TopicPartition(topics.receipts, 0, 0)])
        deadline, values = time.monotonic() + 60, []
        while not values and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                values.append(msg.value())
        consumer.close()
        assert values == [b"kept"]
    finally:
        assert again.stop() == 0, "".join(again.lines)


def test_broker_says_what_it_needs_when_java_or_the_jars_are_missing(tmp_path):
    empty = tmp_path / "no-jars"
    empty.mkdir()
    proc = subprocess.run([sys.executable, "-m", "stage", "broker", "--jars", str(empty)], cwd=ROOT,
                          env=_env(PATH=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "java not found on PATH: Kafka 4 needs Java 17 or newer" in proc.stderr
    assert f"Kafka jars not found in {empty}" in proc.stderr and "make kafka-jars" in proc.stderr
    assert "libs/ directory of an Apache Kafka 4.x download" in proc.stderr


def test_an_old_java_is_named_with_the_version_kafka_needs(tmp_path):
    fake = tmp_path / "java"
    fake.write_text('#!/bin/sh\necho \'java version "1.8.0_412"\' >&2\n')
    fake.chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "stage", "broker", "--jars", str(tmp_path)], cwd=ROOT,
                          env=_env(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "is Java 8: Kafka 4 needs Java 17 or newer" in proc.stderr
    assert (java_major('openjdk version "17.0.15" 2025-04-15'), java_major('openjdk version "21" 2023'),
            java_major("no version here")) == (17, 21, None)


@needs_jars
def test_a_port_in_use_is_refused_before_the_jvm_starts(kafka):
    port = int(kafka.bootstrap.rsplit(":", 1)[1])
    proc = subprocess.run([sys.executable, "-m", "stage", "broker", "--port", str(port),
                           "--controller-port", str(free_port())], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use (a broker already running?): choose another with --port" \
        in proc.stderr
