"""Recovery after the only broker restarts, measured with the stage's default settings.

    PYTHONPATH=$PWD .venv/bin/python -m tests.faults.restart_bench [--down 55] [--runs 1] [--group-protocol consumer]

The README's dev broker (``rollout-reassembler broker``) is stopped with SIGTERM and started
again ``--down`` seconds later (55-61 s is what a newcomer measured for its restart: longer
than the consumer's 45 s session timeout). Printed per run: the timeline of the recovery (the
stage's events and its /readyz answers, in seconds since the stop and against the broker being
ready again) and the figure: seconds from the broker ready to the last waiting group
published. The broker's own restart time in the same run is the anchor the figure is read
against. docs/guarantees.md carries the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from stage.brokers.kraft import jars_available
from tests.faults.outage import close, restart_under_stage, stage_log_since


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--down", type=float, default=55.0, help="seconds from the stop to the start")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--partitions", type=int, default=4, help="as the dev broker creates them")
    parser.add_argument("--log", action="store_true", help="print the stage's log from the stop on")
    parser.add_argument("--log-level", default="INFO", help="the stage's")
    parser.add_argument("--group-protocol", choices=("classic", "consumer"), default="classic",
                        help="the stage's group_protocol (consumer: KIP-848, the broker's defaults)")
    args = parser.parse_args(argv)
    if not jars_available():
        print("Kafka jars not found (make kafka-jars)", file=sys.stderr)
        return 1
    figures = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="restart-bench-") as tmp:
            seen, context = restart_under_stage(Path(tmp), down_s=args.down, partitions=args.partitions,
                                                 log_level=args.log_level,
                                                 settings={"group_protocol": args.group_protocol})
            try:
                print(f"--- run {run + 1}: broker down {seen.ready - seen.stopped:.1f}s "
                      f"(stop to ready), default settings, group_protocol {args.group_protocol}")
                print("\n".join(seen.timeline()))
                if args.log:
                    print(stage_log_since(context["stage"].log(), seen.stopped))
                if seen.exit_code is not None:
                    print(f"the stage EXITED with {seen.exit_code}")
                    print(context["stage"].tail(40))
                    return 1
                figures.append(seen.recovered_s)
                print(f"every waiting group published {seen.recovered_s:.1f}s after the broker was ready "
                      f"({len(seen.published)} groups; the broker's own restart took "
                      f"{seen.ready - seen.stopped:.1f}s)")
            finally:
                close(context)
    if len(figures) > 1:
        print(f"recovery over {len(figures)} runs: median {statistics.median(figures):.1f}s, "
              f"max {max(figures):.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
