"""``rollout-reassembler bench ...``: the benchmarks' arguments and dispatch (wired into
``stage.cli``). Building the parsers imports nothing heavy."""

from __future__ import annotations

from stage.cli.args import add_parser, at_least, device, positive_float

# stage.bench.finalize.PROFILE_CHOICES (a test keeps them equal): "default" is each benchmark's
# own fixed case (docs/performance.md's figures), the others are stage.workload's named profiles.
PROFILES = ("default", "toy", "agentic-moe", "frontier")
PROFILE_HELP = ("default: the benchmark's fixed case; toy, agentic-moe or frontier: groups of that "
                "workload profile (agentic-moe: N=16, ~64 calls, 32k mean / 128k max tokens, routes "
                "48x8 int8/int16; frontier: the same traffic with routes 40x22 int16, Nemotron-3-Super-"
                "like)")


def add_parsers(commands) -> None:
    bench = add_parser(commands, "bench", "run a benchmark and print its figures")
    which = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")

    verify = add_parser(which, "verify", "verify_and_linearize throughput vs SHA-256 bound")
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.add_argument("--seconds", type=positive_float, default=2.0, help="measuring time per case")
    verify.add_argument("--profile", choices=PROFILES, default="default", help=PROFILE_HELP)

    e2e = add_parser(which, "e2e", "stage vs passthrough throughput and latency on one broker")
    e2e.add_argument("--json", action="store_true", help="print the report as JSON")
    e2e.add_argument("--bootstrap-servers", help="default: start a local KRaft broker from the Kafka jars")
    e2e.add_argument("--profile", choices=PROFILES, default="default", help=PROFILE_HELP)
    e2e.add_argument("--groups", type=at_least(1),
                     help="groups (default: the profile's: default 300 of 4 rollouts, the others 3)")
    e2e.add_argument("--tokens", type=at_least(1), default=128, help="delta tokens per call of the fixed case")
    e2e.add_argument("--layers", type=at_least(0),
                     help="route layers, 0 = no routes (default: the profile's: default 8, agentic-moe 48, "
                          "frontier 40)")
    e2e.add_argument("--routes", choices=("off", "direct", "deferred"), default="off",
                     help="the stage's router replay (off: routes, if staged, are not read)")
    e2e.add_argument("--route-staging", choices=("by-reference", "inline"), default="by-reference",
                     help="how the producers stage routes: by-reference (route chunks on the route topic, "
                          "the staged calls naming them; every record within the default record cap) or "
                          "inline (inside the staged calls, as producers before routes by reference)")
    e2e.add_argument("--group-size", type=at_least(1),
                     help="rollouts per group of a profile (default: the profile's)")
    e2e.add_argument("--no-anchor", action="store_true",
                     help="skip the anchor stage run (deferred: the workload without routes; direct by "
                          "reference: the same groups with routes inline)")
    e2e.add_argument("--repeats", type=at_least(1), default=2,
                     help="times the anchor, stage, stage, anchor block of the anchor comparison runs "
                          "(its medians are compared)")
    e2e.add_argument("--latency-seconds", type=positive_float, default=10.0,
                     help="length of the latency phase")
    e2e.add_argument("--finalize-pool", choices=("thread", "process"), default="thread",
                     help="the stage's finalize_pool")
    e2e.add_argument("--finalize-workers", type=at_least(1), default=1, help="the stage's finalize_workers")
    e2e.add_argument("--profile-stage", metavar="FILE",
                     help="sample the latency phase's stage process with py-spy (on PATH or $PY_SPY) into "
                          "FILE (collapsed stacks) and print its GIL-held time per input record by function "
                          "(default: not sampled)")

    finalize = add_parser(which, "finalize", "finalize_group time split (verify, routes, tensorize)")
    finalize.add_argument("--json", action="store_true", help="print the report as JSON")
    finalize.add_argument("--device", type=device, default="cpu", help="cpu, cuda, cuda:N or auto")
    finalize.add_argument("--repeats", type=at_least(1), default=3, help="runs per mode (the median is shown)")
    finalize.add_argument("--profile", choices=PROFILES, default="default", help=PROFILE_HELP)
    finalize.add_argument("--groups", type=at_least(1), default=1, help="groups measured one by one")
    finalize.add_argument("--modes", default="direct,deferred,no-routes",
                          help="comma-separated routes modes: direct, deferred, no-routes")
    finalize.add_argument("--workers", type=at_least(0), default=0,
                          help="also decode + finalize the groups with 1..N threads and 1..N processes "
                               "(0: skip); use --groups >= 2N")
    finalize.add_argument("--workers-mode", choices=("direct", "deferred", "no-routes"),
                          help="routes mode of the workers measurement (default: the first of --modes)")
    finalize.add_argument("--no-rss", action="store_true",
                          help="skip the RSS of each intake (measured in a fresh process per mode)")
    finalize.add_argument("--torch-threads", type=at_least(0), default=1,
                          help="torch intra-op threads (0: as many as torch picks, one per core)")
    for flag, default, text in (("--rollouts", 8, "rollouts per group of the fixed case"),
                                ("--calls", 32, "calls per rollout of the fixed case"),
                                ("--tokens", 512, "delta tokens per call of the fixed case"),
                                ("--topk", 8, "experts per token K of the fixed case")):
        finalize.add_argument(flag, type=at_least(1), default=default, help=text)
    finalize.add_argument("--layers", type=at_least(0),
                          help="MoE layers L, 0 = no routes (default: the profile's; profile default 48)")

    wire = add_parser(which, "wire", "Avro encode/decode throughput of the hot records")
    wire.add_argument("--json", action="store_true", help="print the report as JSON")
    wire.add_argument("--profile", choices=PROFILES, default="default", help=PROFILE_HELP)

    memory = add_parser(which, "memory", "the stage's resident memory against max_buffered_bytes")
    memory.add_argument("--json", action="store_true", help="print the report as JSON")
    memory.add_argument("--bootstrap-servers", help="default: start a local KRaft broker from the Kafka jars")
    memory.add_argument("--profile", choices=PROFILES[1:], default="agentic-moe", help=PROFILE_HELP)
    memory.add_argument("--groups", type=at_least(1), default=4, help="groups of the profile")
    memory.add_argument("--group-size", type=at_least(1), help="rollouts per group (default: the profile's)")
    memory.add_argument("--routes", choices=("off", "direct", "deferred"), default="deferred",
                        help="the stage's router replay")
    memory.add_argument("--cap-mib", type=at_least(1), default=512, help="max_buffered_bytes in MiB")
    memory.add_argument("--max-record-bytes", type=at_least(1),
                        help="the stage's max_record_bytes (default: the stage's default, 8000000); with "
                             "--route-staging inline a profile's staged calls carry their routes: raise it "
                             "if one is larger (the run says so)")
    memory.add_argument("--route-staging", choices=("by-reference", "inline"), default="by-reference",
                        help="how the producer stages routes: by-reference (route chunks, then the staged "
                             "calls naming them) or inline (inside the staged calls)")
    memory.add_argument("--open", choices=("all", "streaming"), default="all",
                        help="all: every staged call before any receipt (all groups open at once); "
                             "streaming: one group after the other")

    fetch = add_parser(which, "fetch", "DeferredRouteFetcher: rebuild a group's routes vs a raw consume")
    fetch.add_argument("--json", action="store_true", help="print the report as JSON")
    fetch.add_argument("--bootstrap-servers", help="default: start a local KRaft broker from the Kafka jars")
    fetch.add_argument("--profile", choices=PROFILES, default="default", help=PROFILE_HELP)
    fetch.add_argument("--cache-mib", type=at_least(0), default=1024,
                       help="the fetcher's cache budget in MiB (DeferredRouteFetcher cache_bytes)")
    fetch.add_argument("--routes", choices=("inline", "by-reference"), default="inline",
                       help="inline: routes inside the staged calls; by-reference: as route chunks "
                            "on a route topic, the staged calls naming them")
    fetch.add_argument("--torch-threads", type=at_least(0), default=1,
                       help="torch intra-op threads (0: as many as torch picks, one per core)")


def main(args) -> int:
    if args.bench == "verify":
        from stage.bench.verify import run
        report = run(as_json=args.json, min_seconds=args.seconds, profile=args.profile)
        return 0 if report["meets_target"] else 1
    if args.bench == "e2e":
        from stage.bench.e2e import run as run_e2e
        report = run_e2e(bootstrap=args.bootstrap_servers, groups=args.groups, tokens=args.tokens,
                         layers=args.layers, latency_seconds=args.latency_seconds, as_json=args.json,
                         profile=args.profile, routes=args.routes, pool=args.finalize_pool,
                         workers=args.finalize_workers, route_staging=args.route_staging,
                         group_size=args.group_size, anchor=not args.no_anchor,
                         profile_stage=args.profile_stage, repeats=args.repeats)
        return 0 if report["meets_targets"] else 1
    if args.bench == "finalize":
        _torch_threads(args.torch_threads)
        from stage.bench.finalize import run as run_finalize
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        run_finalize(as_json=args.json, device=args.device, repeats=args.repeats, n=args.rollouts,
                     calls=args.calls, tokens=args.tokens, layers=args.layers, topk=args.topk,
                     profile=args.profile, groups=args.groups, modes=modes, workers=args.workers,
                     workers_mode=args.workers_mode, torch_threads=args.torch_threads,
                     rss=not args.no_rss)
        return 0
    if args.bench == "wire":
        from stage.bench.wire import main as wire_main
        return wire_main(["--json"] if args.json else [], profile=args.profile)
    if args.bench == "memory":
        from stage.bench.memory import run as run_memory
        return run_memory(bootstrap=args.bootstrap_servers, profile=args.profile, groups=args.groups,
                          routes=args.routes, cap=args.cap_mib << 20, open_mode=args.open,
                          group_size=args.group_size, as_json=args.json,
                          max_record_bytes=args.max_record_bytes, route_staging=args.route_staging)
    if args.bench == "fetch":
        _torch_threads(args.torch_threads)
        from stage.bench.fetch import run as run_fetch
        run_fetch(bootstrap=args.bootstrap_servers, profile=args.profile, as_json=args.json,
                  cache_bytes=args.cache_mib << 20, routes=args.routes)
        return 0
    return 2


def _torch_threads(count: int) -> None:
    if count:
        import torch
        torch.set_num_threads(count)
