"""What resuming an agentic-moe group costs on a real broker (issue 28, item 4).

    PYTHONPATH=$PWD .venv/bin/python -m tests.client.bench_resume_broker [--crash-after-calls 32]

A JVM broker with the stage's topics (8 partitions); other workers' groups staged first (noise
the resume must not read); then examples/producer_fleet.py stages one agentic-moe-sized group
(N=16 rollouts of 64 calls, a 2,048-token prompt, 256 tool and 256 generated tokens a call,
~34k tokens a rollout, 48x8 routes by reference) and is killed with SIGKILL after
``--crash-after-calls`` calls of every rollout; run again with ``--resume``, it resumes every
rollout in one read. Printed: the fleet's own lines (rollouts resumed and how long that took
next to regenerating the longest at 50 tokens/s, tokens reused and regenerated, records and
bytes read of how many partitions) and the bytes staged in the topics, route topic included,
which the resume does not read. No stage runs: nothing is committed, so the read starts at each
partition's beginning (the most a resume can read). ``--stage``: the stage runs too
(examples/stage.yaml, 2 partitions, a 120 s group timeout), and its summaries are read after
the resume: the group must be published once, complete, with 16 valid rows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from confluent_kafka.admin import AdminClient

from stage.bench.machine import machine_line
from stage.brokers.kraft import KraftBroker, jars_available
from stage.config.model import StageConfig, TopicNames
from stage.runtime.kafka.topics import create_topics

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "bench28."


def fleet(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "examples" / "producer_fleet.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True)


def published(stage, group_id: str, timeout: float = 300) -> str:
    """The stage's summaries of ``group_id`` once one is there (and 3 s more for a second)."""
    from stage.wire import AvroCodec
    from tests.integration.harness import read_all
    codec, deadline, found = AvroCodec("GroupSummary"), time.monotonic() + timeout, []
    while time.monotonic() < deadline and not found:
        time.sleep(3)
        found = [s for s in (codec.decode(m.value()) for m in read_all(stage.bootstrap, stage.topics.finalized_groups))
                 if s["group_id"] == group_id]
    time.sleep(3)
    found = [s for s in (codec.decode(m.value()) for m in read_all(stage.bootstrap, stage.topics.finalized_groups))
             if s["group_id"] == group_id]
    assert len(found) == 1 and (found[0]["outcome"], found[0]["valid_rows"], found[0]["total_rows"]) == \
        ("complete", 16, 16), found
    return f"the stage published {group_id} once: complete, 16 of 16 rows valid"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crash-after-calls", type=int, default=32, help="of the 64 calls of every rollout")
    parser.add_argument("--noise-groups", type=int, default=8, help="other workers' groups (8 calls a rollout)")
    parser.add_argument("--stage", action="store_true", help="run the stage and check what it publishes")
    args = parser.parse_args(argv)
    if not jars_available():
        print("Kafka jars not found (make kafka-jars)", file=sys.stderr)
        return 1
    print(machine_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        broker = KraftBroker(tmp, heap="2g").start()
        stage = None
        try:
            prefix = PREFIX
            if args.stage:
                from tests.examples.test_examples import LocalStage
                stage = LocalStage(broker.bootstrap, Path(tmp), group_timeout_ms="120000").start()
                prefix = stage.prefix
            topics = TopicNames(**{k: prefix + v for k, v in TopicNames().model_dump().items()})
            if stage is None:
                create_topics(AdminClient({"bootstrap.servers": broker.bootstrap}),
                              StageConfig(bootstrap_servers=broker.bootstrap, topics=topics),
                              partitions=8, replication=1, min_insync_replicas=1)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
                   **(stage.env if stage is not None else {})}
            noise = fleet(env, "--groups", str(args.noise_groups), "--group-size", "16", "--turns", "8",
                          "--topic-prefix", prefix, "--run-id", "other")
            assert noise.returncode == 0, noise.stderr[-2000:]
            sizes = ["--groups", "1", "--group-size", "16", "--turns", "64", "--prompt-tokens", "2048",
                     "--tool-tokens", "256", "--generated-tokens", "256", "--route-layers", "48",
                     "--route-topk", "8", "--topic-prefix", prefix, "--run-id", "moe", "--seed", "3"]
            started = time.perf_counter()
            killed = fleet(env, *sizes, "--crash-after-calls", str(args.crash_after_calls))
            print(f"staging until the kill: {time.perf_counter() - started:.1f} s (rc {killed.returncode}): "
                  f"{killed.stdout.strip().splitlines()[-1] if killed.stdout.strip() else killed.stderr[-500:]}")
            resumed = fleet(env, *sizes, "--resume")
            assert resumed.returncode == 0, resumed.stderr[-2000:]
            for line in resumed.stdout.splitlines():
                if line.startswith(("resume", "tokens", "produced")):
                    print(line)
            sizes_on_disk = {name: sum(f.stat().st_size for f in Path(tmp, "data").glob(f"{prefix}{name}-*/*.log"))
                             for name in (topics.staged_calls.removeprefix(prefix),
                                          topics.staged_routes.removeprefix(prefix))}
            print("bytes in the log: " + ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in sizes_on_disk.items()))
            if stage is not None:
                print(published(stage, "moe-p0"))
        finally:
            if stage is not None:
                stage.stop()
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
