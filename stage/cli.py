"""Command line: ``rollout-reassembler`` (also ``python -m stage``)."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-reassembler",
        description="Verify staged RL rollouts and publish canonical training rows.")
    commands = parser.add_subparsers(dest="command", required=True)
    from stage.demo.cli import add_parser as add_demo_parser
    add_demo_parser(commands)
    from stage.debug.cli import add_parsers as add_debug_parsers
    add_debug_parsers(commands)
    bench = commands.add_parser("bench", help="run a benchmark and print its figures")
    which = bench.add_subparsers(dest="bench", required=True)
    verify = which.add_parser("verify", help="verify_and_linearize throughput vs SHA-256 bound")
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.add_argument("--seconds", type=float, default=2.0,
                        help="measuring time per case (default 2.0)")
    e2e = which.add_parser("e2e", help="stage vs passthrough throughput and latency on one broker")
    e2e.add_argument("--json", action="store_true")
    e2e.add_argument("--bootstrap-servers", help="default: start a local KRaft broker from the Kafka jars")
    e2e.add_argument("--groups", type=int, default=300)
    e2e.add_argument("--tokens", type=int, default=128, help="delta tokens per call")
    e2e.add_argument("--layers", type=int, default=8, help="route layers (0 = no routes)")
    e2e.add_argument("--latency-seconds", type=float, default=10.0)
    run = commands.add_parser("run", help="run the stage as a member of its Kafka consumer group")
    run.add_argument("--config", help="YAML config file (environment variables override it)")
    run.add_argument("--bootstrap-servers", help="overrides bootstrap_servers")
    run.add_argument("--log-level", default="INFO")
    topics = commands.add_parser("topics", help="create or check the stage's topics")
    topics_cmd = topics.add_subparsers(dest="topics_command", required=True)
    for name, text in (("create", "create missing topics (co-partitioned, ledger compacted)"),
                       ("check", "check that the topics exist and are co-partitioned")):
        sub = topics_cmd.add_parser(name, help=text)
        sub.add_argument("--config")
        sub.add_argument("--bootstrap-servers")
        if name == "create":
            sub.add_argument("--partitions", type=int, required=True)
            sub.add_argument("--replication", type=int, default=1)
            sub.add_argument("--max-message-bytes", type=int, default=64 << 20)
    finalize = which.add_parser("finalize", help="finalize_group time split (verify, routes, tensorize)")
    finalize.add_argument("--json", action="store_true", help="print the report as JSON")
    finalize.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    finalize.add_argument("--repeats", type=int, default=3)
    for flag, default, text in (("--rollouts", 8, "rollouts per group"), ("--calls", 32, "calls per rollout"),
                                ("--tokens", 512, "delta tokens per call"), ("--layers", 48, "MoE layers L"),
                                ("--topk", 8, "experts per token K")):
        finalize.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from stage.tuning import tune_malloc
    tune_malloc()
    if args.command in ("run", "topics"):
        return _runtime_command(args)
    if args.command == "demo":
        from stage.demo.cli import main as demo_main
        return demo_main(args)
    if args.command in ("inspect", "dead-letters"):
        from stage.debug.cli import main as debug_main
        return debug_main(args, _load)
    if args.command == "bench" and args.bench == "verify":
        from stage.bench.verify import run
        report = run(as_json=args.json, min_seconds=args.seconds)
        return 0 if report["meets_target"] else 1
    if args.command == "bench" and args.bench == "e2e":
        from stage.bench.e2e import run as run_e2e
        report = run_e2e(bootstrap=args.bootstrap_servers, groups=args.groups, tokens=args.tokens,
                         layers=args.layers, latency_seconds=args.latency_seconds, as_json=args.json)
        return 0 if report["meets_targets"] else 1
    if args.command == "bench" and args.bench == "finalize":
        from stage.bench.finalize import run as run_finalize
        run_finalize(as_json=args.json, device=args.device, repeats=args.repeats, n=args.rollouts,
                     calls=args.calls, tokens=args.tokens, layers=args.layers, topk=args.topk)
        return 0
    return 2


def _load(args):
    import dataclasses

    from stage.runtime.config import load_config
    cfg = load_config(args.config)
    if args.bootstrap_servers:
        cfg = dataclasses.replace(cfg, bootstrap_servers=args.bootstrap_servers)
    return cfg


def _runtime_command(args) -> int:
    import logging
    import os

    from confluent_kafka.admin import AdminClient

    from stage.runtime.logs import apply_rejection_log_level
    from stage.runtime.topics import TopologyError, check_copartitioning, create_topics
    logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        apply_rejection_log_level(os.environ)
        cfg = _load(args)
    except (OSError, ValueError) as error:
        print(f"configuration error: {error}", file=sys.stderr)
        return 2
    if args.command == "topics":
        admin = AdminClient({"bootstrap.servers": cfg.bootstrap_servers, **cfg.kafka})
        try:
            if args.topics_command == "create":
                created = create_topics(admin, cfg, partitions=args.partitions,
                                        replication=args.replication,
                                        max_message_bytes=args.max_message_bytes)
                print("created: " + (", ".join(created) if created else "nothing (all exist)"))
            print(f"ok: {check_copartitioning(admin, cfg)} partitions per topic")
            return 0
        except TopologyError as error:
            print(f"topology error: {error}", file=sys.stderr)
            return 1
    from stage.runtime.exits import StageExit
    from stage.runtime.loop import StageRuntime
    runtime = StageRuntime(cfg)
    runtime.install_signal_handlers()
    try:
        runtime.start()
        runtime.run()
    except StageExit as error:
        logging.getLogger("stage").error("stopping (exit %d): %s", error.code, error)
        print(f"rollout-reassembler: {error}", file=sys.stderr)
        return error.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
