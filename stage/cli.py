"""Command line: ``rollout-reassembler`` (also ``python -m stage``)."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-reassembler",
        description="Verify staged RL rollouts and publish canonical training rows.")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark and print its figures")
    which = bench.add_subparsers(dest="bench", required=True)
    verify = which.add_parser("verify", help="verify_and_linearize throughput vs SHA-256 bound")
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.add_argument("--seconds", type=float, default=2.0,
                        help="measuring time per case (default 2.0)")
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
    if args.command == "bench" and args.bench == "verify":
        from stage.bench.verify import run
        report = run(as_json=args.json, min_seconds=args.seconds)
        return 0 if report["meets_target"] else 1
    if args.command == "bench" and args.bench == "finalize":
        from stage.bench.finalize import run as run_finalize
        run_finalize(as_json=args.json, device=args.device, repeats=args.repeats, n=args.rollouts,
                     calls=args.calls, tokens=args.tokens, layers=args.layers, topk=args.topk)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
