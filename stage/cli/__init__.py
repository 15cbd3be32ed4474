"""Command line: ``rollout-reassembler`` (also ``python -m stage``)."""

from __future__ import annotations

import argparse
import sys

from stage.cli.args import LOG_LEVELS, Help, add_parser, at_least, positive_float
from stage.runtime.kafka.topics import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MIN_INSYNC_REPLICAS,
    DEFAULT_REPLICATION,
    DEFAULT_ROUTE_RETENTION_MS,
)


class _Parser(argparse.ArgumentParser):
    """Also refuses combinations of arguments (subcommands' parsers are of this class too)."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        if getattr(parsed, "min_insync_replicas", 0) > getattr(parsed, "replication", 1 << 30):
            self.error(f"--min-insync-replicas ({parsed.min_insync_replicas}) must not exceed "
                       f"--replication ({parsed.replication})")
        return parsed, rest


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rollout-reassembler", formatter_class=Help,
        description="Verify staged RL rollouts and publish canonical training rows. Exit status: 0 "
                    "success, 1 failure (a check, a topic layout), 2 usage error, 3 configuration "
                    "error; `run` has more (docs/operations.md, Exit codes).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from stage.cli.demo import add_parser as add_demo_parser
    add_demo_parser(commands)
    _add_runtime_parsers(commands)
    _add_broker_parser(commands)
    from stage.debug.cli import add_parsers as add_debug_parsers
    add_debug_parsers(commands)
    from stage.cli.bench import add_parsers as add_bench_parsers
    add_bench_parsers(commands)
    return parser


def _add_runtime_parsers(commands) -> None:
    run = add_parser(commands, "run", "run the stage as a member of its Kafka consumer group")
    _add_config_options(run)
    run.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="log level")
    topics = add_parser(commands, "topics", "create or check the stage's topics")
    topics_cmd = topics.add_subparsers(dest="topics_command", required=True, metavar="ACTION")
    create = add_parser(
        topics_cmd, "create", "create missing topics (co-partitioned, ledger compacted); existing "
        "topics that differ from the request are reported, exit 1",
        description="Create the stage's missing topics with the same partition count, "
                    "min.insync.replicas on every topic and a compacted ledger, then check the layout. "
                    "Existing topics that differ in replication or configs are reported (exit status "
                    "1) and the missing ones are created all the same; when an existing topic has "
                    "another partition count, nothing is created (ask for its count). The defaults "
                    "suit a production cluster (exactly-once "
                    "needs 3 replicas and min ISR 2); a single development broker needs "
                    "--replication 1 --min-insync-replicas 1.")
    _add_config_options(create)
    create.add_argument("--partitions", type=at_least(1), required=True,
                        help="partitions of every topic (required): at least the peak replica count")
    create.add_argument("--replication", type=at_least(1), default=DEFAULT_REPLICATION,
                        help="replication factor of every topic")
    create.add_argument("--min-insync-replicas", type=at_least(1), default=DEFAULT_MIN_INSYNC_REPLICAS,
                        help="min.insync.replicas of every topic (at most --replication)")
    create.add_argument("--max-message-bytes", type=at_least(1),
                        help=f"max.message.bytes of the data topics, at least the stage's max_record_bytes "
                             f"+ 64 KiB (default: {DEFAULT_MAX_MESSAGE_BYTES}, managed Kafka's 8 MiB, or "
                             f"max_record_bytes + 64 KiB when that is more)")
    create.add_argument("--route-retention-ms", type=_retention, default=DEFAULT_ROUTE_RETENTION_MS,
                        help="retention.ms of the route topic (cleanup.policy delete): longer than "
                             "the policy takes to consume a group's route plans, with room for a "
                             "trainer restarting from an older checkpoint; -1: for ever "
                             "(default: 604800000, 7 days)")
    check = add_parser(topics_cmd, "check", "check that the topics exist and are co-partitioned; "
                       "warn about replication, min ISR and ledger compaction")
    _add_config_options(check)
    check.add_argument("--require-durable", action="store_true",
                       help="exit 1 when a topic has replication < 3, min.insync.replicas < 2 or a "
                            "ledger that is not compacted (default: warn only)")


def _retention(text: str) -> int:
    value = int(text)
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"must be >= 1 ms, or -1 (for ever), got {value}")
    return value


def _add_broker_parser(commands) -> None:
    broker = add_parser(
        commands, "broker", "run a real single-node Apache Kafka (KRaft) for development, no Docker",
        description="Start a real Apache Kafka 4.x broker (KRaft, one node, on 127.0.0.1) from the "
                    "Kafka jars on the local JVM, print its bootstrap address and keep it running "
                    "until Ctrl-C or SIGTERM. Needs java 17+ and the jars: `make kafka-jars` in a "
                    "clone of this repository (java + mvn, Maven Central), or --jars DIR with the "
                    "libs/ of an Apache Kafka 4.x download. --create-topics also creates the "
                    "stage's topics for one broker (replication 1, min.insync.replicas 1). Exit "
                    "status 0 after a clean stop, 1 when it cannot start or the broker dies.")
    broker.add_argument("--port", type=at_least(1), default=9092, help="the client listener's port")
    broker.add_argument("--controller-port", type=at_least(1), default=9093,
                        help="the KRaft controller's port")
    broker.add_argument("--data-dir", metavar="DIR",
                        help="keep the broker's data here and reuse it on the next start (default: "
                             "a temporary directory, removed when the broker stops)")
    broker.add_argument("--jars", metavar="DIR",
                        help="directory of kafka_2.13-*.jar and its dependencies (default: "
                             "$ROLLOUT_REASSEMBLER_KAFKA_JARS, else .cache/kafka/lib of the "
                             "checkout, where `make kafka-jars` puts them)")
    broker.add_argument("--heap", default="1g", help="the JVM's maximum heap (-Xmx)")
    broker.add_argument("--create-topics", action="store_true",
                        help="create the stage's topics once the broker is up (names from --config; "
                             "default: do not)")
    broker.add_argument("--partitions", type=at_least(1), default=4,
                        help="partitions of every topic, with --create-topics")
    broker.add_argument("--config", metavar="PATH",
                        help="the stage's YAML config, for its topic names with --create-topics "
                             "(default: the default names)")
    broker.add_argument("--start-timeout", type=positive_float, default=120.0,
                        help="seconds to wait for the broker to answer")


def _add_config_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--config", metavar="PATH",
                     help="YAML config file; environment variables override it (default: none, "
                          "built-in defaults and the environment)")
    sub.add_argument("--bootstrap-servers",
                     help="overrides bootstrap_servers of the file and the environment (default: "
                          "from the configuration)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from stage.runtime.malloc import tune_malloc
    tune_malloc()
    if args.command == "run":
        return _run_command(args)
    if args.command == "topics":
        return _topics_command(args)
    if args.command == "broker":
        if args.create_topics:      # its topic names come from --config: checked before Kafka starts
            _, status = _checked(_load, args)
            if status is not None:
                return status
        from stage.brokers.dev import main as broker_main
        return broker_main(args)
    if args.command == "demo":
        from stage.cli.demo import main as demo_main
        return demo_main(args)
    if args.command in ("inspect", "dead-letters"):
        from stage.debug.cli import main as debug_main
        return debug_main(args, _load)
    if args.command == "bench":
        from stage.cli.bench import main as bench_main
        return bench_main(args)
    return 2


def _load(args):
    from stage.config.model import load_config
    servers = getattr(args, "bootstrap_servers", None)
    return load_config(args.config, overrides={} if servers is None else {"bootstrap_servers": servers})


def _checked(step, args):
    """(``step(args)``, None), or (None, EXIT_CONFIG) after printing why: a value, file or
    variable the settings model refuses, named with its source. EXIT_CONFIG is the one status of
    a configuration error in every command (docs/configuration.md)."""
    try:
        return step(args), None
    except (OSError, ValueError) as error:
        from stage.runtime.exits import EXIT_CONFIG
        print(f"configuration error: {error}", file=sys.stderr)
        return None, EXIT_CONFIG


def _configure(args):
    """Logging, then the configuration: (cfg, None), or (None, exit status) after printing why."""
    import logging
    logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def load(args):
        if args.command == "run":
            import os
            from stage.runtime.kafka.logs import apply_rejection_log_level
            apply_rejection_log_level(os.environ)
        return _load(args)
    return _checked(load, args)


def _topics_command(args) -> int:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from stage.runtime.kafka.topics import (
        TopicsDiffer, TopologyError, check_copartitioning, create_topics, durability_warnings,
    )
    cfg, status = _configure(args)
    if cfg is None:
        return status
    if args.topics_command == "create" and args.max_message_bytes is not None:
        from stage.runtime.kafka.topics import check_max_message_bytes
        _, status = _checked(lambda a: check_max_message_bytes(a.max_message_bytes, cfg.max_record_bytes), args)
        if status is not None:
            return status
    admin = AdminClient({"bootstrap.servers": cfg.bootstrap_servers, **cfg.kafka})
    differ = False
    try:
        if args.topics_command == "create":
            try:
                created = create_topics(admin, cfg, partitions=args.partitions,
                                        replication=args.replication,
                                        min_insync_replicas=args.min_insync_replicas,
                                        max_message_bytes=args.max_message_bytes,
                                        route_retention_ms=args.route_retention_ms)
            except TopicsDiffer as error:   # the missing ones were created all the same
                created, differ = error.created, True
                print(f"topology error: {error}", file=sys.stderr)
            print("created: " + (", ".join(created) if created else "nothing" if differ else "nothing (all exist)"))
        print(f"ok: {check_copartitioning(admin, cfg)} partitions per topic")
        weak = durability_warnings(admin, cfg)
        for line in weak:
            print(f"warning: {line}", file=sys.stderr)
        if weak:
            print("warning: fine for a single development broker; in production a committed "
                  "transaction can be lost with one broker (recreate the topics, or raise "
                  "min.insync.replicas with kafka-configs.sh)", file=sys.stderr)
            if getattr(args, "require_durable", False):
                return 1
        return 1 if differ else 0
    except TopologyError as error:
        print(f"topology error: {error}", file=sys.stderr)
        return 1
    except KafkaException as error:   # e.g. no broker answers, or it refuses a creation
        print(f"kafka error: {error.args[0]}", file=sys.stderr)
        return 1


def _run_command(args) -> int:
    import logging
    import os

    cfg, status = _configure(args)
    if cfg is None:
        return status
    from stage.runtime.exits import StageExit
    from stage.runtime.loop import StageRuntime
    from stage.runtime.malloc import idle_trimmer
    runtime = StageRuntime(cfg)
    runtime.install_signal_handlers()
    trimmer = idle_trimmer(runtime.stats.activity)   # free heap back to the OS when idle
    try:
        runtime.start()
        runtime.run()
    except StageExit as error:
        logging.getLogger("stage").error("stopping (exit %d): %s", error.code, error)
        print(f"rollout-reassembler: {error}", file=sys.stderr)
        if error.abandon_threads:   # a thread stuck in the Kafka client would block the exit
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(error.code)
        return error.code
    finally:
        if trimmer is not None:
            trimmer.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
