"""Direct router replay on a real broker with routes staged by reference: producers write each
call's route chunks to the route topic first (claim-check order), then the staged call naming
them by offset (``routes_ref``), then the receipts. The stage reads the route topic as a third
co-partitioned input: the rows are the inline path's byte for byte; a restart mid-group re-reads
the chunks before the committed offset (the ledger and the committed offsets cover the third
input); lost, duplicated, reordered and corrupt chunks reject only the rollout they belong to."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from stage.finalize import ReassemblyConfig
from stage.wire import AvroCodec
from stage.wire.partitioner import LIBRDKAFKA_PARTITIONER
from tests.buffer.by_reference import split_call
from tests.integration.harness import (
    Feeder, RunningStage, expected_rows, make_group, read_all, rows_by_group, setup_topics, stage_config,
    unique_topics,
)

ROWS = AvroCodec("CanonicalRow")
CHUNKS = AvroCodec("RouteChunk")
DIRECT = ReassemblyConfig(router_replay=True, defer_routes=False, route_layers=2, route_topk=2)
CHUNK_BYTES = 24          # every call's routes (28 to 40 bytes of int8) in two chunks


class RouteWriter:
    """Writes route chunks and learns where each landed (the reference names those offsets)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2, "enable.idempotence": True,
                                  "partitioner": LIBRDKAFKA_PARTITIONER})

    def write(self, group_id: str, values: list) -> list[tuple[int, int]]:
        """(partition, offset) of each value (bytes: written as they are), acknowledged."""
        landed: dict[int, tuple[int, int]] = {}
        for i, value in enumerate(values):
            def delivered(err, msg, i=i):
                assert err is None, err
                landed[i] = (msg.partition(), msg.offset())
            raw = value if isinstance(value, bytes) else CHUNKS.encode(value)
            self.producer.produce(self.topic, key=group_id.encode(), value=raw, on_delivery=delivered)
        assert self.producer.flush(30) == 0
        return [landed[i] for i in range(len(values))]


def by_reference(writer: RouteWriter, spec, fault=None) -> list:
    """The group's staged calls by reference, their chunks written first. ``fault(call, chunks)``
    -> (the values to write, which of the written ones the reference names), to damage a call."""
    out = []
    for call, value in enumerate(spec.staged):
        chunks, reference = split_call(value, CHUNK_BYTES)
        written, named = (chunks, list(range(len(chunks)))) if fault is None else fault(call, chunks)
        landed = writer.write(spec.group_id, written)
        [partition] = {p for p, _o in landed}
        out.append(reference(writer.topic, partition, [landed[i][1] for i in named]))
    return out


def _stage(kafka, **overrides):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, finalize=DIRECT, **overrides)
    setup_topics(cfg, partitions=2)
    return cfg, topics, Feeder(kafka.bootstrap, topics), RouteWriter(kafka.bootstrap, topics.staged_routes)


def _rows(kafka, topics) -> dict:
    return rows_by_group([ROWS.decode(m.value()) for m in read_all(kafka.bootstrap, topics.canonical_rows)])


@pytest.mark.parametrize("pool", [{}, {"finalize_pool": "process", "finalize_workers": 2}],
                         ids=["threads", "worker-processes"])
def test_direct_mode_by_reference_publishes_the_inline_paths_rows(kafka, pool):
    cfg, topics, feeder, writer = _stage(kafka, **pool)
    groups = [make_group(f"ref{i}", 3, calls=3, seed=900 + i) for i in range(4)]
    inline = make_group("inline0", 2, calls=2, seed=990)          # an older producer: routes inline
    for spec in groups:
        feeder.staged(spec, by_reference(writer, spec))
        feeder.receipts(spec)
    feeder.staged(inline)
    feeder.receipts(inline)
    feeder.flush()
    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("groups_published") >= 5, 90, "every group published")
        assert stats.count("records_consumed", topic=topics.staged_routes) == sum(
            2 * len(spec.staged) for spec in groups)
    rows = _rows(kafka, topics)
    for spec in [*groups, inline]:
        assert rows[spec.group_id] == expected_rows(spec, DIRECT)


def test_a_restart_mid_group_re_reads_its_chunks_and_publishes_every_group_once(kafka):
    cfg, topics, feeder, writer = _stage(kafka, group_timeout_ms=120_000)
    # one partition (stage.wire.partitioner.partition_for: both on 1 of 2); the waiting group's
    # chunks first: they hold the committed route offset
    waiting = make_group("wait1", 2, calls=2, seed=1)
    done = make_group("done1", 2, calls=2, seed=2)
    waiting_calls = by_reference(writer, waiting)
    done_calls = by_reference(writer, done)
    assert waiting_calls[0]["routes_ref"]["partition"] == done_calls[0]["routes_ref"]["partition"]
    feeder.staged(waiting, waiting_calls)
    feeder.staged(done, done_calls)
    feeder.receipts(done)
    feeder.receipts(waiting, waiting.receipts[:1])         # one of its two receipts
    feeder.flush()
    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("groups_published") >= 1, 60, "the complete group published")
        chunks = 2 * (len(waiting.staged) + len(done.staged))
        stage.wait(lambda: stats.count("records_consumed", topic=topics.staged_routes) >= chunks, 30,
                   "every chunk read")
    feeder.receipts(waiting, waiting.receipts[1:])
    feeder.flush()
    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("groups_published") >= 1, 60, "the waiting group published")
        # the waiting group's chunks are before the committed route offset: read again
        assert stats.count("records_consumed", topic=topics.staged_routes) == chunks
        replayed = stats.count("records_skipped", topic=topics.staged_routes, reason="replayed")
    rows = _rows(kafka, topics)
    assert rows["wait1"] == expected_rows(waiting, DIRECT)
    assert rows["done1"] == expected_rows(done, DIRECT)                     # published once, not twice
    # the published group's chunks, after the waiting group's, were re-read too: the ledger's
    # max_route_offset says they were published (replayed, not buffered again)
    assert replayed == 2 * len(done.staged)


def _but_prompt(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "prompt_ids_for_adv"}


def _fault(kind: str):
    def fault(call: int, chunks: list):
        if call != 1:
            return chunks, list(range(len(chunks)))
        if kind == "lost":           # undecodable bytes where chunk 1 should be: dead-lettered
            return [chunks[0], b"\x00garbage"], [0, 1]
        if kind == "duplicated":     # a retry wrote chunk 0 twice: the reference names the second
            return [chunks[0], chunks[0], chunks[1]], [1, 2]
        if kind == "corrupt":        # its bytes changed after its digest was taken
            data = bytearray(chunks[1]["data"])
            data[-1] ^= 0x40
            return [chunks[0], {**chunks[1], "data": bytes(data)}], [0, 1]
        raise AssertionError(kind)
    return fault


def test_lost_duplicated_reordered_and_corrupt_chunks_reject_only_their_rollout(kafka):
    cfg, topics, feeder, writer = _stage(kafka, group_timeout_ms=4_000)
    specs = {kind: make_group(f"{kind}0", 2, calls=2, seed=40 + i)
             for i, kind in enumerate(["lost", "duplicated", "corrupt", "reordered"])}
    calls = {kind: by_reference(writer, spec, _fault(kind)) for kind, spec in specs.items()
             if kind != "reordered"}
    # reordered: the calls' chunks written last call first, and the calls and receipts interleaved
    reordered = specs["reordered"]
    staged = list(reversed(by_reference(writer, reordered.__class__(
        reordered.group_id, reordered.receipts, list(reversed(reordered.staged))))))
    calls["reordered"] = staged
    for kind, spec in specs.items():
        feeder.receipts(spec)
        feeder.staged(spec, calls[kind])
    feeder.flush()
    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("groups_published") >= 4, 90, "every group published")
        assert stats.count("dead_letters", topic=topics.staged_routes, reason="undecodable") == 1
        assert stats.count("records_skipped", topic=topics.staged_routes, reason="unreferenced") == 1
    rows = _rows(kafka, topics)
    for kind, spec in specs.items():
        expected, got = expected_rows(spec, DIRECT), rows[spec.group_id]
        if kind in ("duplicated", "reordered"):
            assert got == expected, kind
            continue
        # call 1 is the second call of rollout 0: that rollout alone is rejected, with its reason
        # (the group's prompt for advantages is then its first valid sibling's)
        assert not got[0]["valid"] and got[1]["valid"], kind
        assert _but_prompt(got[1]) == _but_prompt(expected[1]), kind
        reason = got[0]["rejection_reason"]
        want = "missing_staging_row" if kind == "lost" else "invalid_staging_row"
        assert reason.startswith(want) and "route chunk 1 of" in reason, reason
        if kind == "corrupt":
            assert "corrupt" in reason
