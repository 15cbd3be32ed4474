"""What a stalled network run looks like from every side, written to one folder when a wait for
published groups fails: each replica's /metrics and (where py-spy is installed) its threads'
stacks, the transactions the brokers hold open, the consumer group as the coordinator sees it,
and every stage topic's log end next to its last stable offset (a read_committed reader stops at
the latter, so an open transaction holds every later record back from the verifier).

    diagnose(run, cluster, folder) -> folder

Best effort throughout: a part that fails writes its error instead, the others still run.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition


def _write(folder: Path, name: str, produce) -> None:
    try:
        text = produce()
    except Exception as error:  # noqa: BLE001 - a diagnostic must not hide the failure it documents
        text = f"{type(error).__name__}: {error}\n"
    (folder / name).write_text(text)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _stacks(pid: int) -> str:
    spy = shutil.which("py-spy") or str(Path(__import__("sys").executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "py-spy not installed (pip install py-spy)\n"
    done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def _kafka_tool(cluster, *args: str) -> str:
    node = cluster.kraft.nodes[0]
    done = subprocess.run(["java", "-Xmx256m", "-cp", f"{node.jars}/*", *args], capture_output=True,
                          text=True, timeout=120)
    return done.stdout + done.stderr


def _offsets(bootstrap: str, topics: list[str]) -> str:
    """Per topic-partition: log end (read_uncommitted high watermark) and last stable offset."""
    readers = {iso: Consumer({"bootstrap.servers": bootstrap, "group.id": f"diag-{iso}-{time.time()}",
                              "isolation.level": iso}) for iso in ("read_committed", "read_uncommitted")}
    lines = ["topic partition last_stable log_end held_back"]
    try:
        for topic in topics:
            meta = readers["read_committed"].list_topics(topic, timeout=10).topics.get(topic)
            for p in sorted(meta.partitions if meta is not None else ()):
                tp = TopicPartition(topic, p)
                stable = readers["read_committed"].get_watermark_offsets(tp, timeout=10, cached=False)[1]
                end = readers["read_uncommitted"].get_watermark_offsets(tp, timeout=10, cached=False)[1]
                lines.append(f"{topic} {p} {stable} {end} {end - stable}")
    finally:
        for reader in readers.values():
            reader.close()
    return "\n".join(lines) + "\n"


def diagnose(run, cluster, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for replica, proc in run.procs.items():
        port = run.cfgs[replica].metrics_port
        if port:
            _write(folder, f"metrics-{replica}.txt", lambda port=port: _metrics(port))
        if proc.alive():
            _write(folder, f"stacks-{replica}.txt", lambda pid=proc.pid: _stacks(pid))
    bootstrap = cluster.bootstrap
    cfg = next(iter(run.cfgs.values()))
    topics = [cfg.topics.receipts, cfg.topics.staged_calls, cfg.topics.canonical_rows, cfg.topics.route_plans,
              cfg.topics.finalized_groups, cfg.topics.stage_ledger, cfg.topics.dead_letter]
    _write(folder, "offsets.txt", lambda: _offsets(bootstrap, topics))
    _write(folder, "transactions.txt", lambda: "\n".join(
        _kafka_tool(cluster, "org.apache.kafka.tools.TransactionsCommand", "--bootstrap-server", bootstrap,
                    "describe", "--transactional-id", c.effective_transactional_id)
        for c in run.cfgs.values()) + _kafka_tool(
        cluster, "org.apache.kafka.tools.TransactionsCommand", "--bootstrap-server", bootstrap, "list"))
    _write(folder, "group.txt", lambda: _kafka_tool(
        cluster, "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand", "--bootstrap-server", bootstrap,
        "--describe", "--group", cfg.group_id, "--members", "--verbose") + _kafka_tool(
        cluster, "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand", "--bootstrap-server", bootstrap,
        "--describe", "--group", cfg.group_id, "--offsets"))
    return folder
