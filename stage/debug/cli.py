"""Command-line parts of ``inspect`` and ``dead-letters`` (wired into ``stage.cli``)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from datetime import datetime, timezone

from stage.publish.deadletters import ERROR_CLASSES
from stage.runtime.exits import EXIT_CONFIG, EXIT_OK, EXIT_USAGE

EXIT_FAILED = 1
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_time(text: str, now_ms: int | None = None) -> int:
    """Epoch milliseconds from ``1764500000000`` (ms), ``2026-11-30T10:00:00Z`` (ISO 8601; no
    zone = UTC) or a duration before now (``90s``, ``15m``, ``2h``, ``3d``)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    text = text.strip()
    if text.isdigit():
        return int(text)
    match = _DURATION.match(text)
    if match:
        return now_ms - int(float(match.group(1)) * _UNITS[match.group(2)])
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time: use epoch ms, ISO 8601 (2026-11-30T10:00:00Z) or a duration "
            "before now (90s, 15m, 2h, 3d)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def _at(text: str) -> tuple[int, int]:
    partition, sep, offset = text.partition(":")
    if not sep or not partition.isdigit() or not offset.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected PARTITION:OFFSET of the dead-letter topic")
    return int(partition), int(offset)


def _config_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--config", metavar="PATH", help="the stage's YAML config file, as for run: topics, "
                     "bootstrap servers, kafka: client properties (SASL/TLS); environment variables "
                     "override it (default: none, built-in defaults and the environment)")
    sub.add_argument("--bootstrap-servers", metavar="HOSTS",
                     help="overrides bootstrap_servers (default: from --config or the environment)")
    sub.add_argument("--json", action="store_true", help="print one JSON document for scripts (default: text)")
    sub.add_argument("--quiet", action="store_true",
                     help="no progress lines on stderr for long scans (default: shown)")


def _window_options(sub: argparse.ArgumentParser, what: str) -> None:
    sub.add_argument("--since", type=parse_time, metavar="TIME",
                     help=f"read {what} from records at or after TIME: epoch ms, ISO 8601 or a duration "
                          "before now like 2h (default: from the beginning)")
    sub.add_argument("--until", type=parse_time, metavar="TIME",
                     help=f"read {what} up to records before TIME (default: to the end)")


def _filter_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--error-class", action="append", choices=ERROR_CLASSES, default=[],
                     help="only this error class; repeatable (default: every class)")
    sub.add_argument("--source-topic", help="only dead letters from this topic (default: any)")
    sub.add_argument("--source-partition", type=int, help="only from this source partition (default: any)")
    sub.add_argument("--key", metavar="GROUP_ID",
                     help="only the dead letters of this group: keyed so, or naming it in their "
                          "value under another key (misrouted); list and replay select the same "
                          "ones (default: any)")
    sub.add_argument("--grep", metavar="TEXT", help="only errors containing TEXT (default: any)")
    _window_options(sub, "dead letters")


def add_parsers(commands) -> None:
    inspect = commands.add_parser(
        "inspect", help="show one group: its summary, every row's status and rejection reason, "
                        "its staging keys and where its input records sit",
        description="Find a group on the stage's topics (its partition follows from the key and "
                    "the contract's partitioner) and print its GroupSummary, every row's status "
                    "and rejection reason, its route plans, its ledger entry, its staging keys, "
                    "the partitions and offsets of its input records and dead letters keyed by "
                    "it. Scans are bounded by the summary's timestamps. Exit status 0 when a "
                    "summary was found, 1 when not, 2 for a usage error, 3 for a configuration error.")
    inspect.add_argument("group_id", metavar="GROUP_ID", help="the prompt group id (the Kafka key)")
    _config_options(inspect)
    _window_options(inspect, "summaries (and, without a summary, inputs)")
    inspect.add_argument("--slack-ms", type=int, default=60_000,
                         help="widen every time-bounded scan by this much on each side, for clock "
                              "skew between producers (default 60000)")
    dead = commands.add_parser("dead-letters", help="list dead letters, or re-produce selected ones "
                                                    "to their source topic (each at most once)")
    actions = dead.add_subparsers(dest="dead_letters_command", required=True, metavar="ACTION")
    listing = actions.add_parser(
        "list", help="list dead letters (source coordinates, error, size, replayed or not)",
        description="List dead letters with their source topic/partition/offset, error class, "
                    "error and value size, and whether they were re-produced. Exit status 0, "
                    "2 for a usage error, 3 for a configuration error.")
    _config_options(listing)
    _filter_options(listing)
    listing.add_argument("--limit", type=int, default=100,
                         help="show at most this many (the count of all matches is printed; default 100)")
    replay = actions.add_parser(
        "replay", help="re-produce selected dead letters to their source topics, each at most once",
        description="Re-produce the selected dead letters to their source topic, keyed and "
                    "partitioned as the contract requires, each with a marker in the replay log "
                    "in the same transaction, so a second replay skips it. Select with the "
                    "filters, --at, or --all. A record of a group the ledger says is published "
                    "is refused (the stage would count the copy late) unless --into-published. "
                    "Exit status 0 when every selected record was re-produced (now or before), "
                    "1 when one was refused, 2 for a usage error, 3 for a configuration error.")
    _config_options(replay)
    _filter_options(replay)
    replay.add_argument("--at", action="append", type=_at, default=[], metavar="PARTITION:OFFSET",
                        help="this dead letter (its partition and offset in the dead-letter topic); "
                             "repeatable (default: none)")
    replay.add_argument("--all", action="store_true",
                        help="every dead letter (default: a filter or --at is required)")
    replay.add_argument("--rekey", action="store_true",
                        help="re-produce records whose key is not their group id (misrouted) keyed "
                             "by the group id (default: refuse them)")
    replay.add_argument("--into-published", action="store_true",
                        help="re-produce records of groups the ledger says are published too, with a "
                             "warning (the stage counts such a copy as a late record and never uses "
                             "it; default: refuse them)")
    replay.add_argument("--dry-run", action="store_true",
                        help="show what would be re-produced, produce nothing (default: produce)")
    replay.add_argument("--replay-log", metavar="TOPIC",
                        help="compacted topic of replay markers, created on first use "
                             "(default: <dead-letter topic>.replays)")


def main(args, load_config) -> int:
    """``load_config(args)`` -> StageConfig (stage.cli's loader, so --config and
    --bootstrap-servers mean what they mean for run)."""
    from confluent_kafka import KafkaException
    try:
        cfg = load_config(args)
    except (OSError, ValueError) as error:    # the same message and status as every command's
        print(f"configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG
    from stage.debug.kafka import PartitionReader, Progress
    reader = PartitionReader(cfg, "inspect" if args.command == "inspect" else "dead-letters",
                             Progress(not args.quiet))
    try:
        if args.command == "inspect":
            return _inspect(args, cfg, reader)
        return _dead_letters(args, cfg, reader)
    except (LookupError, TimeoutError, KafkaException, RuntimeError) as error:
        print(f"rollout-reassembler {args.command}: {error}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as error:
        print(f"rollout-reassembler {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        reader.close()


def _codecs(cfg):
    from stage.runtime.kafka.registry import build_codecs   # not the loop's module: it imports torch
    return build_codecs(cfg)


def _inspect(args, cfg, reader) -> int:
    from stage.debug.inspect_group import GroupInspector
    from stage.debug.text import format_report
    report = GroupInspector(cfg, reader, _codecs(cfg), since_ms=args.since, until_ms=args.until,
                            slack_ms=args.slack_ms).report(args.group_id)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print("\n".join(format_report(report)))
    return EXIT_OK if report["summaries"] else EXIT_FAILED


def _filters(args):
    from stage.debug.deadletters import Filters
    return Filters(error_classes=set(args.error_class), source_topic=args.source_topic,
                   source_partition=args.source_partition,
                   key=None if args.key is None else args.key.encode("utf-8"), grep=args.grep,
                   at=set(getattr(args, "at", []) or []))


def _dead_letters(args, cfg, reader) -> int:
    from stage.debug import deadletters as dl
    from stage.debug.text import dead_letter_lines, source
    filters = _filters(args)
    if args.dead_letters_command == "replay" and not (filters.any or args.all):
        print("dead-letters replay: select what to re-produce (a filter, --at) or pass --all",
              file=sys.stderr)
        return EXIT_USAGE
    log_topic = getattr(args, "replay_log", None) or dl.replay_log_topic(cfg)
    codecs = _codecs(cfg)
    if args.dead_letters_command == "list":
        views, read = dl.find(cfg, reader, filters, since_ms=args.since, until_ms=args.until, codecs=codecs)
        markers = dl.read_markers(reader, log_topic)
        shown = views[:max(0, args.limit)]
        rows = [v.as_dict(markers.get(v.marker_key)) for v in shown]
        if args.json:
            print(json.dumps({"matched": len(views), "shown": len(rows), "records_read": read,
                              "dead_letters": rows}, indent=2, sort_keys=True))
        else:
            for row in rows:
                print(dead_letter_lines(row))
            print(f"{len(views)} dead letter(s) matched of {read} read" +
                  (f", {len(rows)} shown (--limit)" if len(rows) < len(views) else ""))
        return EXIT_OK
    replayer = dl.Replayer(cfg, reader, codecs, log_topic=log_topic, rekey=args.rekey,
                           dry_run=args.dry_run, into_published=args.into_published)
    replayer.prepare()
    views, _ = dl.find(cfg, reader, filters, since_ms=args.since, until_ms=args.until, codecs=codecs)
    results = []
    for view in views:
        status, detail, target = replayer.plan(view)
        warning = (target or {}).get("warning")
        if warning:     # said before the copy is produced
            print(f"warning: {view.record.topic}[{view.record.partition}]@{view.record.offset}: {warning}",
                  file=sys.stderr, flush=True)
        if status == "ready":
            marker = replayer.replay(view, target)
            to = marker["replayed_to"]
            status, detail = "replayed", (f"to {to['topic']}[{to['partition']}]@{to['offset']}"
                                          + (" (rekeyed)" if target["rekeyed"] else ""))
        elif status == "would_replay":
            detail = (f"to {target['topic']}[{target['partition']}]"
                      + (" (rekeyed)" if target["rekeyed"] else ""))
        results.append({**view.as_dict(), "status": status, "detail": detail, "warning": warning})
    counts = {s: sum(1 for r in results if r["status"] == s)
              for s in ("replayed", "would_replay", "already_replayed", "refused")}
    if args.json:
        print(json.dumps({"replay_log": log_topic, "counts": counts, "results": results},
                         indent=2, sort_keys=True))
    else:
        for r in results:
            d = r["dead_letter"]
            print(f"{r['status']:<16} {d['topic']}[{d['partition']}]@{d['offset']} "
                  f"(from {source(r)}, {r['error_class']}): {r['detail']}")
        print(", ".join(f"{n} {s.replace('_', ' ')}" for s, n in counts.items() if n or s == "replayed")
              + f" (replay log {log_topic})")
    return EXIT_FAILED if counts["refused"] else EXIT_OK
