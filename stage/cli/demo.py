"""``rollout-reassembler demo`` arguments and entry point (wired into ``stage.cli``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from stage.cli.args import (
    LOG_LEVELS,
    at_least,
    device,
    fraction,
    non_negative_float,
    positive_float,
    topic_prefix,
)
from stage.cli.args import add_parser as add_subcommand

# stage.workload.faults' names (ROLLOUT_FAULTS + GARBAGE; a test keeps them equal), spelled out so
# that building the parser imports nothing heavy (`rollout-reassembler --help` stays instant).
FAULT_NAMES = ("tampered_tokens", "tampered_digest", "poisoned_receipt", "missing_receipt",
               "missing_staged", "late_receipt", "garbage")
# stage.workload.profiles' names (a test keeps them equal) and what each changes in the demo
# beyond the workload: agentic-moe and frontier rows reach 128k tokens (direct routes would be
# ~100 MB a row, 225 MB at frontier dims) and a group is ~1,000 staged calls, so they default to
# deferred routes and a longer deadline.
PROFILE_NAMES = ("toy", "agentic-moe", "frontier")
# Their faults at a lower rate: a group of 16 rollouts with one late or lost record waits out
# its 2-minute deadline.
_LONG = {"routes": "deferred", "group_timeout_ms": 120_000, "fault_rate": 0.005}
PROFILE_DEMO_DEFAULTS = {"toy": {"routes": "direct", "group_timeout_ms": 3000, "fault_rate": 0.03},
                         "agentic-moe": dict(_LONG), "frontier": dict(_LONG)}


def add_parser(commands) -> argparse.ArgumentParser:
    demo = add_subcommand(
        commands, "demo", "run the whole system on a synthetic workload and check every output",
        description="Start the embedded Tansu broker (or use --bootstrap-servers), create the topics, "
                    "stage a seeded synthetic agentic workload with injected faults through the producer "
                    "SDK, run the stage, read the rows back with the trainer-side reader and check them "
                    "against an independent recomputation. Exit status 0 only if every check passes, "
                    "1 if one fails, 2 for a bad argument.")
    demo.add_argument("--bootstrap-servers", help="any Kafka (default: start the embedded Tansu broker)")
    demo.add_argument("--profile", choices=PROFILE_NAMES, default="toy",
                      help="workload sizes: toy (seconds), agentic-moe (N=16, ~64 calls, 32k mean / "
                           "128k max tokens a rollout, routes 48x8 int8/int16: 2 groups, minutes, "
                           "several GB of memory) or frontier (the same traffic at a frontier MoE's "
                           "routes, 40x22 int16, Nemotron-3-Super-like: ~0.9 GB of routes a group; the demo "
                           "keeps copies of every group's routes for its checks: 2 groups peaked at "
                           "~20 GB); "
                           "the options below override it")
    demo.add_argument("--groups", type=at_least(1), help="prompt groups (default: the profile's, toy 64)")
    demo.add_argument("--group-size", type=at_least(1), help="rollouts per group, N (default: the profile's, toy 4)")
    demo.add_argument("--seed", type=int, default=0, help="workload seed: same seed, same run")
    demo.add_argument("--partitions", type=at_least(1), default=2, help="partitions per topic")
    demo.add_argument("--routes", choices=("direct", "deferred", "off"),
                      help="router replay: routes in the rows (direct), plans + fetch by Kafka "
                           "coordinates (deferred), or none (off) (default: toy direct, agentic-moe and frontier "
                           "deferred)")
    demo.add_argument("--layers", type=at_least(0),
                      help="MoE layers L (0: no routes; needs --routes off) (default: toy 4, agentic-moe 48, "
                           "frontier 40)")
    demo.add_argument("--experts-per-token", type=at_least(1), help="MoE top-k K (default: toy 2, agentic-moe 8, frontier 22)")
    demo.add_argument("--media-rate", type=fraction,
                      help="share of rollouts whose prompt carries an image (default: toy 0.1, the others 0)")
    demo.add_argument("--sampler-topk", type=at_least(0), default=0,
                      help="sampler top-k log-prob columns per generated token (0: none)")
    demo.add_argument("--fault-rate", type=fraction,
                      help="rate of every fault: per rollout for each rollout fault, per group for "
                           "garbage (default: toy 0.03, the others 0.005)")
    demo.add_argument("--fault", action="append", default=[], metavar="NAME=RATE",
                      help=f"override one fault's rate; NAME in {', '.join(FAULT_NAMES)} "
                           "(default: none, every fault at --fault-rate)")
    demo.add_argument("--group-timeout-ms", type=at_least(1),
                      help="the stage's group deadline (default: toy 3000, the others 120000)")
    demo.add_argument("--max-record-bytes", type=at_least(1),
                      help="the record cap of the stage, its topics, the producers and the readers "
                           "(default: the stage's, 8000000, what managed Kafka takes; larger only on a "
                           "broker whose topics allow it)")
    demo.add_argument("--rate", type=non_negative_float, default=0.0,
                      help="groups per second offered (0: as fast as the producer goes)")
    demo.add_argument("--timeout", type=positive_float, default=300.0,
                      help="seconds to wait for every group at the reader")
    demo.add_argument("--device", type=device, default="cpu",
                      help="torch device of the stage and reader: cpu, cuda, cuda:N or auto")
    demo.add_argument("--topic-prefix", type=topic_prefix, help="topic name prefix (default: demo-<random>)")
    demo.add_argument("--produce-only", action="store_true",
                      help="only produce the workload (to the standard topic names, or --topic-prefix) "
                           "and exit: the input of a stage running elsewhere, e.g. docker compose's")
    demo.add_argument("--json-report", metavar="PATH", help="also write the report as JSON (default: none)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    demo.add_argument("--log-level", default="ERROR", type=str.upper, choices=LOG_LEVELS,
                      help="log level of the stage and clients (ERROR by default: the injected faults "
                           "make the stage log warnings by design)")
    return demo


def _fault_rates(args):
    from stage.workload import FaultRates
    rate = PROFILE_DEMO_DEFAULTS[args.profile]["fault_rate"] if args.fault_rate is None else args.fault_rate
    rates = {name: rate for name in FAULT_NAMES}
    for item in args.fault:
        name, sep, value = item.partition("=")
        if not sep or name not in FAULT_NAMES:
            raise ValueError(f"--fault {item!r}: expected NAME=RATE with NAME in {', '.join(FAULT_NAMES)}")
        rates[name] = float(value)
    return FaultRates(**rates)


def options(args):
    from stage.demo import DemoOptions
    from stage.workload import profile
    defaults = PROFILE_DEMO_DEFAULTS[args.profile]
    routes = args.routes or defaults["routes"]
    given = {"groups": args.groups, "group_size": args.group_size, "route_layers": args.layers,
             "route_topk": args.experts_per_token, "media_rate": args.media_rate}
    overrides = {name: value for name, value in given.items() if value is not None}
    if routes == "off":
        overrides["route_layers"] = 0
    workload = profile(args.profile, seed=args.seed, topk=args.sampler_topk, faults=_fault_rates(args),
                       **overrides)
    return DemoOptions(
        workload=workload, profile=args.profile, bootstrap_servers=args.bootstrap_servers,
        partitions=args.partitions, route_mode=routes,
        group_timeout_ms=args.group_timeout_ms or defaults["group_timeout_ms"], timeout_s=args.timeout,
        rate=args.rate, device=args.device, topic_prefix=args.topic_prefix,
        **({} if args.max_record_bytes is None else {"max_record_bytes": args.max_record_bytes}),
        progress=not args.no_progress, produce_only=args.produce_only)


def main(args) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.ERROR),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = options(args)
    except ValueError as error:
        print(f"demo: {error}", file=sys.stderr)
        return 2
    from stage.demo import render, run_demo, write_json
    try:
        report = run_demo(opts)
    except Exception as error:  # noqa: BLE001 - a run that cannot finish is a failed run
        print(f"demo failed: {type(error).__name__}: {error}", file=sys.stderr)
        if args.json_report:
            with open(args.json_report, "w") as f:
                json.dump({"ok": False, "error": f"{type(error).__name__}: {error}"}, f, indent=2)
        return 1
    if report.get("mode") == "produce-only":
        print(f"produced {report['groups']} groups, {report['input_records']} records "
              f"({report['input_bytes'] / 1e6:.2f} MB) in {report['seconds']:.1f} s to "
              f"{report['topics']['receipts']} and {report['topics']['staged_calls']}")
    else:
        print(render(report))
    if args.json_report:
        write_json(report, args.json_report)
    return 0 if report["ok"] else 1
