#!/usr/bin/env python3
"""Check a trainer run against the topics: was every published group trained exactly once?

    python examples/check_trainer.py --checkpoint trainer.ckpt        # broker 127.0.0.1:9092

It reads the checkpoint ``examples/trainer_loop.py`` writes (the groups trained, those set aside
as stale, the reader's position) and the stage's topics: the group summaries (every group the
stage published, one record each) and the keys and offsets of the canonical rows (where each
group's rows are, compared with the position). Every published group is then exactly one of:

  trained   in the checkpoint's trained list once
  stale     set aside once as too old for the policy (--max-lag)
  not yet   its rows are at or past the reader's position: the next run reads them
  missing   its rows are below the position, yet it was neither trained nor set aside
  twice     trained or set aside more than once

and the exit status is 0 when no group is missing or twice, 1 otherwise. Groups the stage
published with no rows (summary ``outcome`` dropped) are counted apart: no reader sees them.
The rows topic is read once, values included (Kafka has no key-only fetch), so on a production
topic point --topic-prefix and --bootstrap-servers at what the trainer read and expect a scan.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections import Counter

import torch
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from stage.client import BrokerUnreachable, ReadPosition
from stage.client.connection import kafka_logger, reach
from stage.client.consuming import DEFAULT_MAX_RECORD_BYTES, fetch_limits
from stage.wire import AvroCodec, TopicNames


def topic_names(prefix: str) -> TopicNames:
    """The stage's topics (``topics:`` of its config): the default names, with a prefix."""
    return TopicNames(**{role: prefix + name for role, name in TopicNames().all().items()})


def scan(consumer: Consumer, topic: str, visit) -> None:
    """``visit(partition, offset, key, value)`` for every committed record of ``topic``, from
    its beginning to its end as it is now."""
    partitions = sorted(consumer.list_topics(topic, timeout=15).topics[topic].partitions)
    for partition in partitions:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=15)
        if high <= low:
            continue
        consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
        last = low - 1
        while last < high - 1:
            msg = consumer.poll(10.0)
            if msg is None:
                raise TimeoutError(f"{topic}[{partition}]: nothing read for 10 s at offset {last + 1}")
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    break
                raise RuntimeError(f"{topic}[{partition}]: {msg.error()}")
            last = msg.offset()
            visit(partition, last, msg.key(), msg.value())
        consumer.unassign()


def published_groups(consumer: Consumer, topics: TopicNames) -> tuple[set[str], set[str]]:
    """(groups published with rows, groups published with none) from the summaries topic."""
    codec, with_rows, without = AvroCodec("GroupSummary"), set(), set()

    def visit(_partition, _offset, _key, value):
        summary = codec.decode(value)
        (with_rows if summary["total_rows"] else without).add(summary["group_id"])
    scan(consumer, topics.finalized_groups, visit)
    return with_rows, without


def rows_reached(consumer: Consumer, topics: TopicNames, position: ReadPosition) -> dict[str, bool]:
    """Per group with rows: whether all of them lie below the position (read past)."""
    offsets = position.offsets()
    below: dict[str, bool] = {}

    def visit(partition, offset, key, _value):
        group = key.decode("utf-8", "replace") if key is not None else ""
        start = offsets.get((topics.canonical_rows, partition))
        below[group] = below.get(group, True) and start is not None and offset < start
    scan(consumer, topics.canonical_rows, visit)
    return below


def classify(published: set[str], trained: list[str], stale: list[str], read_past: dict[str, bool],
             handed_out: set[str]) -> dict[str, list[str]]:
    """Each published group's class (module doc); groups of the checkpoint the topics do not
    know (retention, other topics) are ``unknown``."""
    seen = Counter(trained) + Counter(stale)
    trained_set, stale_set = set(trained), set(stale)
    out: dict[str, list[str]] = {k: [] for k in ("trained", "stale", "not yet", "missing", "twice", "unknown")}
    for group in sorted(published):
        if seen[group] > 1:
            out["twice"].append(group)
        elif group in trained_set:
            out["trained"].append(group)
        elif group in stale_set:
            out["stale"].append(group)
        elif read_past.get(group, False) or group in handed_out:   # the reader passed it
            out["missing"].append(group)
        else:
            out["not yet"].append(group)
    out["unknown"] = sorted(set(seen) - published)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
                        help="Kafka bootstrap list (default: $KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092)")
    parser.add_argument("--topic-prefix", default="", help="prefix of the stage's topic names")
    parser.add_argument("--checkpoint", default="trainer.ckpt", help="the trainer's checkpoint file")
    parser.add_argument("--max-record-bytes", type=int, default=DEFAULT_MAX_RECORD_BYTES,
                        help="the stage's max_record_bytes: the largest row record to fetch")
    parser.add_argument("--list", action="store_true", help="print the group ids of every class")
    args = parser.parse_args(argv)

    if not os.path.exists(args.checkpoint):
        print(f"check_trainer.py: no checkpoint at {args.checkpoint} (--checkpoint)", file=sys.stderr)
        return 1
    saved = torch.load(args.checkpoint, weights_only=True)
    position = ReadPosition.from_dict(saved["reader"]) if saved.get("reader") else ReadPosition()
    topics = topic_names(args.topic_prefix)
    consumer = Consumer({"bootstrap.servers": args.bootstrap_servers, "group.id": f"check-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True, "logger": kafka_logger(),
                         **fetch_limits(args.max_record_bytes)})
    try:
        reach(consumer, args.bootstrap_servers, "check_trainer.py", 15.0)
        published, dropped = published_groups(consumer, topics)
        read_past = rows_reached(consumer, topics, position)
    except BrokerUnreachable as error:
        print(f"check_trainer.py: {error}; here the address is --bootstrap-servers", file=sys.stderr)
        return 1
    finally:
        consumer.close()
    classes = classify(published, saved["trained"], saved["stale"], read_past, position.handed_out())
    print(f"checkpoint {args.checkpoint}: step {saved['step']}, weight version {saved['weight_version']}")
    print(f"published {len(published)} groups with rows ({len(dropped)} more dropped with none) "
          f"on {topics.finalized_groups}")
    for name, groups in classes.items():
        if groups or name != "unknown":       # unknown: trained, but no summary (retention?)
            shown = f": {' '.join(groups)}" if args.list and groups else ""
            print(f"{name:<9} {len(groups)}{shown}")
    bad = classes["missing"] or classes["twice"]
    print("result: " + ("FAIL: a group was lost or trained twice" if bad else
                        "OK, every published group read so far was trained or set aside exactly once"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
