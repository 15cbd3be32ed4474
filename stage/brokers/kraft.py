"""A real Apache Kafka 4.x broker (KRaft, single node) on loopback, from Maven Central jars.

Used by the integration tests (when no KAFKA_BOOTSTRAP_SERVERS is given and no Docker engine
answers, or KAFKA_TEST_BROKER=jvm), by `bench e2e` and by `rollout-reassembler broker`
(stage.brokers.dev). The jars are resolved once into ``.cache/kafka/lib`` (``make kafka-jars``). The broker
is configured for a single node: transaction-log replication and min ISR 1 (else
init_transactions hangs), no initial rebalance delay, large messages for route fragments.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# `make kafka-jars` resolves them here; ROLLOUT_REASSEMBLER_KAFKA_JARS points elsewhere.
JARS = Path(os.environ.get("ROLLOUT_REASSEMBLER_KAFKA_JARS", ROOT / ".cache" / "kafka" / "lib"))
MESSAGE_MAX_BYTES = 64 << 20

_LOG4J = """\
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def _die_with_parent() -> None:
    """Linux: the broker gets SIGKILL when the process that started it dies (a killed test
    run must not leave JVMs behind)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_cluster_id() -> str:
    cluster_id = "-"
    while not cluster_id[0].isalnum():  # a leading '-' would be read as an option by the tool
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    return cluster_id


def wait_ready(bootstrap: str, timeout: float, *, alive, where) -> None:
    """Until the broker at ``bootstrap`` answers a metadata request; ``alive()`` False (the
    process or container is gone) or the timeout raise, with ``where()`` (its log) attached."""
    from confluent_kafka.admin import AdminClient
    deadline = time.monotonic() + timeout
    quiet = logging.getLogger("kraft.wait")  # connection-refused noise while it starts
    quiet.setLevel(logging.CRITICAL)
    admin = AdminClient({"bootstrap.servers": bootstrap}, logger=quiet)
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"Kafka broker at {bootstrap} exited during start-up:\n{where()}")
        try:
            if admin.list_topics(timeout=2).brokers:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.3)
    raise TimeoutError(f"Kafka broker at {bootstrap} not ready after {timeout}s:\n{where()}")


def jars_available(jars: Path | None = None) -> bool:
    jars = JARS if jars is None else Path(jars)
    return jars.is_dir() and any(jars.glob("kafka_2.13-*.jar")) and shutil.which("java") is not None


class KraftBroker:
    """Start with ``start()``; ``bootstrap`` is ``127.0.0.1:<port>``; ``stop()`` kills it.

    Alone it is a single-node cluster; ``KraftCluster`` runs several as one (``node_id``,
    ``voters``: the controller quorum, ``props``: overrides such as replication factors)."""

    kind = "kraft-jvm"

    def __init__(self, workdir: str | None = None, port: int | None = None, *, node_id: int = 1,
                 controller_port: int | None = None, voters: str | None = None,
                 props: dict | None = None, heap: str = "1g", jars: Path | None = None) -> None:
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="kraft-"))
        self._owned = workdir is None      # a directory of its own: discard() removes it
        self.jars = JARS if jars is None else Path(jars)
        self.port = port or free_port()
        self.controller_port = controller_port or free_port()
        self.node_id = node_id
        self.voters = voters or f"{node_id}@127.0.0.1:{self.controller_port}"
        self.props = dict(props or {})
        self.heap = heap
        self.cluster_id: str | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        data = self.dir / "data"
        data.mkdir(parents=True, exist_ok=True)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters,
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(data),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "message.max.bytes": str(MESSAGE_MAX_BYTES),
            "replica.fetch.max.bytes": str(MESSAGE_MAX_BYTES),
            "transaction.max.timeout.ms": "900000",
            "log.flush.interval.messages": "9223372036854775807",
            **self.props,
        }
        path = self.dir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (self.dir / "log4j2.properties").write_text(_LOG4J.format(log=self.dir / "broker.log"))
        return path

    def _java(self, *args: str) -> list[str]:
        # G1 (the JVM default, as Kafka runs it): SerialGC paused the broker for 100+ ms at a
        # time under the e2e benchmark's large records.
        return ["java", "-Xms256m", f"-Xmx{self.heap}",
                f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
                "-cp", f"{self.jars}/*", *args]

    def start(self, timeout: float = 90.0, *, wait: bool = True) -> "KraftBroker":
        if not jars_available(self.jars):
            raise RuntimeError(f"Kafka jars not found in {self.jars} (run `make kafka-jars`) or no java")
        config = self._write_config()
        cluster_id = self.cluster_id or new_cluster_id()
        if not (self.dir / "data" / "meta.properties").exists():
            subprocess.run(self._java("kafka.tools.StorageTool", "format", "-t", cluster_id,
                                      "-c", str(config), "--ignore-formatted"),
                           check=True, capture_output=True, timeout=120)
        out = open(self.dir / "stdout.log", "ab")
        self.proc = subprocess.Popen(self._java("kafka.Kafka", str(config)), stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        if wait:
            self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        wait_ready(self.bootstrap, timeout, alive=lambda: self.proc.poll() is None, where=self.log_tail)

    @property
    def description(self) -> str:
        return f"kraft-jvm (Maven jars on the local JVM) at {self.bootstrap}"

    def log_tail(self, lines: int = 200) -> str:
        """The broker's log4j file (and its stdout, where a failed start says why), last lines."""
        out = []
        for name in ("broker.log", "stdout.log"):
            path = self.dir / name
            if path.is_file():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path} ---\n" + "\n".join(text))
        return "\n".join(out) or f"(no broker log in {self.dir})"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def discard(self) -> None:
        """Stop, and remove the directory it made for itself (its logs hold every record
        written: a benchmark's broker leaves GBs in /tmp otherwise). A directory it was given
        is the caller's and stays."""
        self.stop()
        if self._owned:
            shutil.rmtree(self.dir, ignore_errors=True)


class KraftCluster:
    """Several combined broker+controller nodes on loopback, one KRaft quorum: replication 3
    and min ISR 2 by default (transaction and offsets logs too), so that killing one broker
    is a leader failover, not an outage. Small heaps: three nodes fit a 2-core machine."""

    def __init__(self, nodes: int = 3, *, min_isr: int = 2, props: dict | None = None,
                 heap: str = "384m") -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kraft-cluster-"))
        ports = [(free_port(), free_port()) for _ in range(nodes)]
        voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports))
        replication = str(min(3, nodes))
        shared = {
            "offsets.topic.replication.factor": replication,
            "transaction.state.log.replication.factor": replication,
            "transaction.state.log.min.isr": str(min_isr),
            "default.replication.factor": replication,
            "min.insync.replicas": str(min_isr),
            # a dead broker is fenced (its partitions fail over) within a few seconds
            "broker.session.timeout.ms": "6000",
            "broker.heartbeat.interval.ms": "1000",
            **(props or {}),
        }
        cluster_id = new_cluster_id()
        self.nodes: list[KraftBroker] = []
        for i, (port, controller) in enumerate(ports):
            node = KraftBroker(str(self.root / f"node{i + 1}"), port, node_id=i + 1,
                               controller_port=controller, voters=voters, props=shared, heap=heap)
            node.cluster_id = cluster_id
            self.nodes.append(node)

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    def start(self, timeout: float = 120.0) -> "KraftCluster":
        for node in self.nodes:   # the quorum forms only once a majority runs: start all first
            node.start(wait=False)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node._wait_ready(max(1.0, deadline - time.monotonic()))
        self.wait_brokers(len(self.nodes), timeout=max(1.0, deadline - time.monotonic()))
        return self

    def _metadata(self):
        """Cluster metadata through a consumer: librdkafka's admin client has aborted a process
        (an enq_once assertion) beside a broker restart; a consumer's metadata request has not."""
        from confluent_kafka import Consumer
        quiet = logging.getLogger("kraft.wait")
        quiet.setLevel(logging.CRITICAL)
        return Consumer({"bootstrap.servers": self.bootstrap, "group.id": "kraft-wait"}, logger=quiet)

    def wait_brokers(self, count: int, timeout: float = 60.0) -> None:
        reader = self._metadata()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    if len(reader.list_topics(timeout=2).brokers) >= count:
                        return
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                time.sleep(0.3)
        finally:
            reader.close()
        raise TimeoutError(f"{count} brokers not registered after {timeout}s; see {self.root}")

    def wait_in_sync(self, timeout: float = 120.0) -> None:
        """Until no partition of any topic (internal ones included) is under-replicated: what a
        rolling restart waits for before it stops the next broker."""
        reader = self._metadata()
        try:
            deadline = time.monotonic() + timeout
            lagging: list = ["(no metadata yet)"]
            while time.monotonic() < deadline:
                try:
                    topics = reader.list_topics(timeout=2).topics
                    lagging = [f"{name}[{p}]" for name, topic in topics.items()
                               for p, part in topic.partitions.items() if set(part.isrs) != set(part.replicas)]
                    if not lagging:
                        return
                except Exception:  # noqa: BLE001 - a broker still starting
                    pass
                time.sleep(0.5)
        finally:
            reader.close()
        raise TimeoutError(f"under-replicated after {timeout}s: {lagging[:10]}; see {self.root}")

    def node(self, node_id: int) -> KraftBroker:
        return self.nodes[node_id - 1]

    def leader_of(self, topic: str, partition: int) -> int:
        from confluent_kafka.admin import AdminClient
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        return admin.list_topics(topic, timeout=10).topics[topic].partitions[partition].leader

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def discard(self) -> None:
        """Stop every node and remove the cluster's directory."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
