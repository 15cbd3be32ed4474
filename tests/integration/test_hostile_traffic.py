"""Hostile records mixed into valid traffic, end to end on a real broker: the fuzz families that
hold today (tests/fuzz/mutate.py) produce their records, valid and hostile, to the input topics
of a running stage, and every input record is accounted for by its offset: dead-lettered (the
dead letter names its source offset), published (a receipt as its row, a staged call inside its
group's ledger entry, or expired as an orphan), or skipped as a duplicate or late copy (the
stage's skip counts equal the copies exactly). No partition halts, every group has N rows."""

from __future__ import annotations

import os
import random
from collections import defaultdict

from stage.wire import AvroCodec, WireError
from stage.wire.partitioner import partition_for
from tests.fuzz.mutate import GENERAL
from tests.fuzz.traffic import PARTITIONS, RECEIPTS, Wire
from tests.integration.harness import (
    Feeder, RunningStage, read_all, setup_topics, stage_config, unique_topics,
)

CASES = int(os.environ.get("HOSTILE_CASES", "60"))
FAMILIES = sorted(set(GENERAL) - {"mixed"})   # a mix would reuse group ids across its parts
ROWS, SUMMARY, LEDGER = AvroCodec("CanonicalRow"), AvroCodec("GroupSummary"), AvroCodec("LedgerEntry")
RECEIPT, STAGED = AvroCodec("ReceiptEvent", budget=False), AvroCodec("StagedCall", budget=False)


def hostile_traffic(seed: int) -> list[Wire]:
    """CASES fuzz cases of distinct groups, their records in production order."""
    wires, used, taken = [], set(), 0
    for index in range(CASES * 20):
        family = FAMILIES[index % len(FAMILIES)]
        case = GENERAL[family](random.Random(f"e2e:{seed}:{family}:{index}"))
        if used & set(case.group_sizes):
            continue   # the same base workload again: its group ids would collide
        used |= set(case.group_sizes)
        wires += case.wires
        taken += 1
        if taken == CASES:
            break
    return wires


class Produced:
    """What the test produced: (topic, partition, offset) -> the wire record."""

    def __init__(self, feed: Feeder, topics) -> None:
        self.feed, self.topics = feed, topics
        self.at: dict[tuple, Wire] = {}

    def send(self, wires) -> None:
        for wire in wires:
            topic = self.topics.receipts if wire.role == RECEIPTS else self.topics.staged_calls
            partition = wire.partition
            if partition is None:
                partition = partition_for(wire.key, PARTITIONS) if wire.key is not None else 0
            self.feed.producer.produce(
                topic, key=wire.key, value=wire.value, partition=partition,
                on_delivery=lambda err, msg, wire=wire: self._delivered(err, msg, wire))
        self.feed.flush()

    def _delivered(self, err, msg, wire) -> None:
        assert err is None, err
        self.at[(msg.topic(), msg.partition(), msg.offset())] = wire


def _settled(runtime, produced: int) -> bool:
    if runtime.halted:
        raise AssertionError(f"a partition halted: {runtime.halted}")
    return (runtime.stats.total("records_consumed") >= produced
            and not any(b.open_groups for b in runtime.buffers.values())
            and not (runtime.finalization.busy or runtime.publication.done or runtime.publication.in_flight
                     or runtime.publication.dead_letters))


def test_every_hostile_and_valid_record_is_accounted_for_by_offset(kafka):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=3000, late_retention_ms=600_000)
    setup_topics(cfg, partitions=PARTITIONS)
    produced = Produced(Feeder(kafka.bootstrap, topics), topics)
    wires = hostile_traffic(seed=18)
    produced.send([w for w in wires if w.phase == 0])
    with RunningStage(cfg) as stage:
        runtime = stage.runtime
        stage.wait(lambda: _settled(runtime, len(produced.at)), 120, "the first round")
        produced.send([w for w in wires if w.phase == 1])   # copies of published records
        stage.wait(lambda: _settled(runtime, len(produced.at)), 120, "the late copies")
        stats = runtime.stats
        skipped = {t: sum(v for (n, labels), v in stats.counters.items()
                          if n == "records_skipped" and dict(labels).get("topic") == t
                          and dict(labels).get("reason") != "conflict")
                   for t in (topics.receipts, topics.staged_calls)}
        orphans = stats.total("orphan_staged_expired")
    assert len(produced.at) == len(wires) >= 400

    letters = {}
    for msg in read_all(kafka.bootstrap, topics.dead_letter):
        headers = dict(msg.headers())
        where = (headers["source-topic"].decode(), int(headers["source-partition"]),
                 int(headers["source-offset"]))
        assert where not in letters, f"{where} dead-lettered twice"
        assert headers["error"] and headers["error-class"], where
        letters[where] = headers["error"].decode()
    summaries = {s["group_id"]: s for s in map(SUMMARY.decode, (
        m.value() for m in read_all(kafka.bootstrap, topics.finalized_groups)))}
    ledger = {e["group_id"]: e for e in map(LEDGER.decode, (
        m.value() for m in read_all(kafka.bootstrap, topics.stage_ledger) if m.value()))}
    rows = defaultdict(dict)
    for row in map(ROWS.decode, (m.value() for m in read_all(kafka.bootstrap, topics.canonical_rows))):
        assert row["row_index"] not in rows[row["group_id"]], f"{row['sample_id']} published twice"
        rows[row["group_id"]][row["row_index"]] = row
    for group_id, summary in summaries.items():
        assert sorted(rows[group_id]) == list(range(summary["group_size"])), group_id
        assert summary["total_rows"] == summary["group_size"]

    # Every record the stage did not dead-letter decodes: it was buffered or skipped.
    first: dict[tuple, tuple] = {}   # identity -> (offset, value) of its first copy
    copies = defaultdict(int)        # topic -> records that were not the first of their identity
    for (topic, partition, offset) in sorted(produced.at):
        wire = produced.at[(topic, partition, offset)]
        if (topic, partition, offset) in letters:
            continue
        try:
            value = (RECEIPT if wire.role == RECEIPTS else STAGED).decode(wire.value or b"")
        except WireError as error:
            raise AssertionError(f"{topic}[{partition}]@{offset} ({wire.note}) does not decode "
                                 f"({error}) and was not dead-lettered: lost") from None
        which = value["rollout_index"] if wire.role == RECEIPTS else value["staging_key"]
        identity = (topic, value["group_id"], which)
        if identity in first:
            copies[topic] += 1
        else:
            first[identity] = (partition, offset, value)
    orphaned = 0
    for (topic, group_id, which), (partition, offset, value) in first.items():
        if topic == topics.receipts:
            row = rows[group_id].get(which)
            assert row is not None, f"receipt {topic}[{partition}]@{offset} has no row"
            assert row["rollout_id"] == value["rollout_id"]
        elif group_id in summaries:
            entry = ledger[group_id]
            assert entry["partition"] == partition and entry["max_staged_offset"] >= offset
        else:
            orphaned += 1
    assert skipped == {t: copies[t] for t in skipped}, (skipped, dict(copies))
    assert orphans == orphaned
    accounted = len(letters) + len(first) + sum(copies.values())
    assert accounted == len(produced.at)
    # the mix exercised every kind of outcome
    assert len(letters) > 40 and sum(copies.values()) > 10 and len(summaries) > 50 and orphaned, (
        len(letters), dict(copies), len(summaries), orphaned)
    print(f"{len(produced.at)} records: {len(letters)} dead-lettered, {len(first)} buffered "
          f"({orphaned} orphan staged calls), {sum(copies.values())} skipped copies; "
          f"{len(summaries)} groups, {sum(len(r) for r in rows.values())} rows")
