"""Checkpointed reading on a real broker: a trainer process (tests/client/trainer_proc.py, the
docs/trainer.md's trainer loop) killed with SIGKILL at random points, and crashing itself between
training, checkpointing and committing, is restarted from its last checkpoint until it has
every group; across the whole run each group is in its train state exactly once (trained, or
set aside as too stale for the policy), and the lag-monitoring commits match its position.

Rows arrive while the trainer runs, interleaved across groups, in transactions of which some
abort and are retried (as the stage's are), so positions regularly fall inside groups. And a
position whose records the topic no longer holds (retention, a recreated topic) is reported."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.client import CanonicalReader
from stage.wire import TopicNames
from stage.wire.partitioner import LIBRDKAFKA_PARTITIONER, partition_for
from tests.client.rows import group_rows, interleaved_log
from tests.integration.harness import setup_topics, stage_config, unique_topics

ROOT = Path(__file__).resolve().parents[2]
GROUPS = 60
KILLS = 6


def _weight_version(index: int) -> int:
    """Mostly the step the trainer is near when the group arrives; every fifth group 3 older."""
    return max(0, index // 2 - (3 if index % 5 == 0 else 0))


class RowFeeder(threading.Thread):
    """Produces the groups' rows interleaved, 4 records a transaction, aborting (and then
    re-sending) one transaction in five, paced so that production outlasts several restarts."""

    def __init__(self, bootstrap: str, topic: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.rng = random.Random(seed)
        ids = [f"g{i:03d}" for i in range(GROUPS)]
        self.ids = ids
        self.log = interleaved_log(ids, self.rng, rows_of=lambda gid: group_rows(
            gid, weight_version=_weight_version(int(gid[1:]))))
        self.topic = topic
        self.producer = Producer({"bootstrap.servers": bootstrap, "partitioner": LIBRDKAFKA_PARTITIONER,
                                  "transactional.id": f"feeder-{topic}", "linger.ms": 1})
        self.error: BaseException | None = None
        self.aborted = 0
        # The last transaction waits for this: the test's kills then all fall before the trainer
        # could have every group (pacing alone left that to the machine's speed: CI once saw
        # the feed end after 2 of the 6 kills).
        self.release = threading.Event()

    def run(self) -> None:
        try:
            self.producer.init_transactions(30)
            for start in range(0, len(self.log), 4):
                chunk = self.log[start:start + 4]
                if start + 4 >= len(self.log):
                    self.release.wait(600)
                if self.rng.random() < 0.2:
                    self._transaction(chunk, commit=False)
                    self.aborted += 1
                self._transaction(chunk, commit=True)
                time.sleep(0.25)
        except BaseException as error:  # noqa: BLE001 - surfaced by the test
            self.error = error

    def _transaction(self, chunk, commit: bool) -> None:
        self.producer.begin_transaction()
        for gid, _, raw in chunk:
            self.producer.produce(self.topic, key=gid.encode(), value=raw)
        self.producer.flush(30)
        if commit:
            self.producer.commit_transaction(30)
        else:
            self.producer.abort_transaction(30)


class Trainer:
    def __init__(self, bootstrap: str, tag: str, checkpoint: Path, log: Path, seed: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.log = log
        self.starts_before = log.read_text(errors="replace").count("reading:")
        self._out = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.client.trainer_proc", "--bootstrap", bootstrap, "--prefix", tag,
             "--checkpoint", str(checkpoint), "--total", str(GROUPS), "--crash-rate", "0.05",
             "--seed", str(seed)],
            cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_reading(self, timeout: float = 120) -> None:
        """Until this incarnation logged that it is reading (or exited)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.log.read_text(errors="replace").count("reading:") > self.starts_before:
                return
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._out.close()


def _saved_groups(checkpoint: Path) -> int:
    if not checkpoint.exists():
        return 0
    state = json.loads(checkpoint.read_text())
    return len(state["trained"]) + len(state["stale"])


def test_a_trainer_killed_at_random_points_trains_every_group_exactly_once(kafka, tmp_path):
    topics = unique_topics()
    setup_topics(stage_config(kafka.bootstrap, topics), partitions=2)
    tag = topics.canonical_rows[:-len(TopicNames().canonical_rows) - 1]
    checkpoint, log = tmp_path / "trainer.json", tmp_path / "trainer.log"
    log.touch()
    feeder = RowFeeder(kafka.bootstrap, topics.canonical_rows, seed=7)
    feeder.start()
    rng = random.Random(11)
    kills = crashes = mid_run_kills = 0
    deadline = time.monotonic() + 420
    for attempt in range(100):
        assert time.monotonic() < deadline, f"the trainer did not finish\n{log.read_text()[-3000:]}"
        trainer = Trainer(kafka.bootstrap, tag, checkpoint, log, seed=attempt)
        trainer.wait_reading()
        if kills < KILLS:
            time.sleep(rng.uniform(0.2, 1.2))
        if kills < KILLS and trainer.proc.poll() is None:
            trainer.kill()
            kills += 1
            mid_run_kills += _saved_groups(checkpoint) < GROUPS
            if kills == KILLS:
                feeder.release.set()
            continue
        try:
            rc = trainer.proc.wait(300)
        finally:
            trainer.kill()
        if rc == 0:
            break
        assert rc == -signal.SIGKILL, f"trainer exited {rc}\n{log.read_text()[-3000:]}"
        crashes += 1
    feeder.release.set()
    feeder.join(60)
    assert feeder.error is None, feeder.error
    text = log.read_text(errors="replace")
    state = json.loads(checkpoint.read_text())
    seen = Counter(state["trained"] + state["stale"])
    assert set(seen) == set(feeder.ids), f"missing {sorted(set(feeder.ids) - set(seen))}"
    assert all(count == 1 for count in seen.values()), {g: c for g, c in seen.items() if c > 1}
    # the run really was interrupted, by us and by itself, and aborted transactions were read past
    assert text.count("reading:") == kills + crashes + 1, text[-3000:]
    assert mid_run_kills >= 3 and kills + crashes >= 4, (mid_run_kills, kills, crashes, text[-3000:])
    assert feeder.aborted > 0
    # Kafka group commits stay in step with the checkpoint (for lag monitoring)
    position = {(p["topic"], p["partition"]): p["offset"] for p in state["reader"]["partitions"]}
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": f"trainer-{tag}"})
    committed = consumer.committed([TopicPartition(t, p) for t, p in position], timeout=30)
    consumer.close()
    assert {(c.topic, c.partition): c.offset for c in committed} == position


def test_records_deleted_since_the_checkpoint_are_counted_and_logged_not_silently_skipped(kafka, caplog):
    topics = unique_topics()
    setup_topics(stage_config(kafka.bootstrap, topics), partitions=2)
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "partitioner": LIBRDKAFKA_PARTITIONER})
    ids = [gid for gid in (f"r{i}" for i in range(40)) if partition_for(gid.encode(), 2) == 0][:2]
    for gid in ids:                                   # two groups, 3 rows each, in partition 0
        for _, raw in group_rows(gid):
            producer.produce(topics.canonical_rows, key=gid.encode(), value=raw)
    assert producer.flush(30) == 0
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for future in admin.delete_records([TopicPartition(topics.canonical_rows, 0, 3)]).values():
        future.result()                               # retention took the first group
    position = {"version": 1, "partitions": [
        {"topic": topics.canonical_rows, "partition": 0, "offset": 0, "handed_out": {}},
        {"topic": topics.canonical_rows, "partition": 1, "offset": 50, "handed_out": {}}]}
    with CanonicalReader(kafka.bootstrap, topics=topics, start_from=position,
                         config={"fetch.wait.max.ms": 20}) as reader:
        assert [g.group_id for g in reader.read(1, timeout=30)] == [ids[1]]
        assert reader.counts["lost_to_retention"] == 3 and reader.counts["position_past_end"] == 1
    assert "3 records were deleted (retention)" in caplog.text and "was the topic recreated" in caplog.text
