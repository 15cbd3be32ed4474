"""``rollout-reassembler broker``: a real single-node Apache Kafka (KRaft) for development.

The same broker the integration tests run (stage.brokers.kraft: Kafka 4.x from the Maven Central
jars on the local JVM, no Docker), started in the foreground: it prints its bootstrap address,
optionally creates the stage's topics for one broker (replication 1, min.insync.replicas 1), and
runs until Ctrl-C or SIGTERM, then stops the JVM cleanly. It listens on 127.0.0.1 only.

What it needs, checked before anything starts, each with the way to get it: ``java`` 17 or newer
on PATH (Kafka 4 needs it), and the Kafka jars: ``make kafka-jars`` in a clone of this repository
(java + mvn; Maven Central into .cache/kafka/lib), or ``--jars DIR`` /
``ROLLOUT_REASSEMBLER_KAFKA_JARS`` naming a directory with ``kafka_2.13-*.jar`` and its
dependencies, such as the ``libs/`` directory of an Apache Kafka 4.x download.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from stage.brokers.kraft import JARS, KraftBroker

MIN_JAVA = 17
EXIT_OK, EXIT_FAILED = 0, 1


def java_major(version_text: str) -> int | None:
    """The major version in ``java -version`` output (``"17.0.15"`` -> 17, ``"1.8.0_412"`` -> 8)."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_text)
    if match is None:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def kafka_version(jars: Path) -> str | None:
    for jar in sorted(jars.glob("kafka_2.13-*.jar")):
        match = re.fullmatch(r"kafka_2\.13-(\d[\w.]*)\.jar", jar.name)
        if match:
            return match.group(1)
    return None


def missing_requirements(jars: Path) -> list[str]:
    """What is missing to start the broker, one line each with how to get it (empty: all there)."""
    problems = []
    java = shutil.which("java")
    if java is None:
        problems.append(f"java not found on PATH: Kafka 4 needs Java {MIN_JAVA} or newer (e.g. "
                        f"`apt-get install openjdk-{MIN_JAVA}-jre-headless`, or a JDK from adoptium.net)")
    else:
        try:
            out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
            major = java_major(out.stderr + out.stdout)
        except (OSError, subprocess.SubprocessError) as error:
            major, out = None, error
        if major is None:
            problems.append(f"could not read the version of {java} (`java -version`): {out}")
        elif major < MIN_JAVA:
            problems.append(f"{java} is Java {major}: Kafka 4 needs Java {MIN_JAVA} or newer")
    if not (jars.is_dir() and kafka_version(jars)):
        problems.append(
            f"Kafka jars not found in {jars}. In a clone of this repository run `make kafka-jars` "
            f"(needs java and mvn: resolves Apache Kafka 4.x, ~45 MB, from Maven Central into "
            f".cache/kafka/lib); or pass --jars DIR (or set ROLLOUT_REASSEMBLER_KAFKA_JARS) to a "
            f"directory holding kafka_2.13-*.jar and its dependencies, e.g. the libs/ directory of "
            f"an Apache Kafka 4.x download")
    return problems


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port (SO_REUSEADDR, as Kafka binds: a port left in TIME_WAIT
    by a broker that just stopped is free)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _create_topics(broker: KraftBroker, args) -> str:
    """Create the stage's topics for one broker; a line saying what was done."""
    from confluent_kafka.admin import AdminClient

    from stage.config.model import load_config
    from stage.runtime.kafka.topics import check_copartitioning, create_topics
    cfg = load_config(args.config, overrides={"bootstrap_servers": broker.bootstrap})
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    created = create_topics(admin, cfg, partitions=args.partitions, replication=1, min_insync_replicas=1)
    count = check_copartitioning(admin, cfg)
    return (f"topics: {len(created)} created, {count} partitions each, replication 1, "
            f"min.insync.replicas 1 (one broker): {', '.join(created) if created else 'all existed'}")


def main(args) -> int:
    jars = Path(args.jars) if args.jars else JARS
    problems = missing_requirements(jars)
    for port, flag in ((args.port, "--port"), (args.controller_port, "--controller-port")):
        if not port_free(port):
            problems.append(f"port {port} on 127.0.0.1 is in use (a broker already running?): "
                            f"choose another with {flag}")
    if problems:
        print("rollout-reassembler broker: cannot start:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return EXIT_FAILED
    temporary = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="rollout-reassembler-kafka-")) if temporary else Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    reused = (data_dir / "data" / "meta.properties").exists()
    broker = KraftBroker(str(data_dir), args.port, controller_port=args.controller_port, heap=args.heap,
                         jars=jars)
    stop = threading.Event()
    print(f"starting Apache Kafka {kafka_version(jars)} (KRaft, single node) from {jars} ...", flush=True)
    try:
        try:
            broker.start(timeout=args.start_timeout)
        except (RuntimeError, TimeoutError, subprocess.SubprocessError) as error:
            print(f"rollout-reassembler broker: the broker did not start: {error}", file=sys.stderr)
            return EXIT_FAILED
        for sig in (signal.SIGINT, signal.SIGTERM):     # from here on: stop cleanly, then exit 0
            signal.signal(sig, lambda *_: stop.set())
        print(f"bootstrap: {broker.bootstrap}", flush=True)
        kept = ("temporary, removed when the broker stops; --data-dir DIR keeps it" if temporary
                else "reused" if reused else "new; kept, reused by the next start")
        print(f"data: {data_dir} ({kept})\nlog: {data_dir / 'broker.log'}", flush=True)
        if args.create_topics:
            try:
                print(_create_topics(broker, args), flush=True)
            except Exception as error:  # noqa: BLE001 - a configuration or topic layout error
                print(f"rollout-reassembler broker: creating the topics failed: {error}", file=sys.stderr)
                return EXIT_FAILED
        print(f"ready: export KAFKA_BOOTSTRAP_SERVERS={broker.bootstrap} (the stage, the examples and "
              f"the other commands read it); Ctrl-C or SIGTERM stops the broker", flush=True)
        while not stop.wait(0.5):
            if broker.proc.poll() is not None:
                print(f"rollout-reassembler broker: the broker exited (status {broker.proc.returncode})"
                      f":\n{broker.log_tail(40)}", file=sys.stderr)
                return EXIT_FAILED
        print("stopping the broker ...", flush=True)
        return EXIT_OK
    except KeyboardInterrupt:       # Ctrl-C while it was still starting
        return 130
    finally:
        broker.stop()
        if temporary:
            shutil.rmtree(data_dir, ignore_errors=True)
        print("broker stopped", flush=True)
