"""A producer in another language, written from docs/producers.md and docs/schemas.md only
(tests/crosslang/goproducer: franz-go, hamba/avro), against a real broker and the stage with
direct router replay: it writes routes by reference (route chunks first, then the staged calls
naming them) and the references check against the chunks where they landed; its groups verify,
its rows carry the tokens and routes it meant (boundary-repaired positions included), and what
it gets wrong on purpose is caught as the doc says."""

from __future__ import annotations

import json
import subprocess
import zlib
from pathlib import Path

import numpy as np

from stage.finalize import ReassemblyConfig
from stage.staging.route_refs import RouteReference, check_chunk, join_chunks
from stage.wire import AvroCodec, TopicNames, unpack_tensor
from stage.wire.partitioner import partition_for
from tests.integration.harness import RunningStage, read_all, setup_topics, stage_config, unique_topics

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "tests" / "conformance" / "vectors"
ROWS, SUMMARY = AvroCodec("CanonicalRow"), AvroCodec("GroupSummary")
STAGED, CHUNKS = AvroCodec("StagedCall"), AvroCodec("RouteChunk")
PARTITIONS = 3
CHUNK_BYTES = 16      # a call's 5-9 tokens of 2x2 int8 routes: two or three chunks


def run_go(binary: Path, bootstrap: str, topics: TopicNames, *args: str) -> dict:
    done = subprocess.run(
        [str(binary), "produce", "-brokers", bootstrap, "-staged-topic", topics.staged_calls,
         "-receipts-topic", topics.receipts, "-routes-topic", topics.staged_routes,
         "-route-chunk-bytes", str(CHUNK_BYTES), "-partitions", str(PARTITIONS),
         "-schemas", str(ROOT / "schemas"), *args],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def direct_replay_config(bootstrap: str, topics: TopicNames):
    return stage_config(bootstrap, topics, group_timeout_ms=30_000,
                        finalize=ReassemblyConfig(router_replay=True, defer_routes=False))


def published(bootstrap: str, topics: TopicNames) -> tuple[dict, dict]:
    """group id -> summary, group id -> rows in row_index order."""
    summaries: dict = {}
    for message in read_all(bootstrap, topics.finalized_groups):
        summary = SUMMARY.decode(message.value())
        assert summary["group_id"] not in summaries, f"{summary['group_id']} published twice"
        summaries[summary["group_id"]] = summary
    rows: dict = {}
    for message in read_all(bootstrap, topics.canonical_rows):
        row = ROWS.decode(message.value())
        rows.setdefault(row["group_id"], []).append(row)
    return summaries, {g: sorted(r, key=lambda row: row["row_index"]) for g, r in rows.items()}


def tensor(row: dict, name: str) -> np.ndarray:
    return unpack_tensor(row[name], field=name)


def check_references(bootstrap: str, topics: TopicNames, report: dict) -> int:
    """Every staged call the Go producer wrote names its routes by reference, as the stage's
    own checks read a reference: chunks acknowledged before any staged call, on the call's
    partition, each matching its digest, joining to the routes the rollout meant. Returns how
    many chunks were checked."""
    kinds = [d["kind"] for d in report["deliveries"]]
    assert kinds == sorted(kinds, key=["chunk", "staged", "receipt"].index)   # claim-check order
    chunks = {(m.partition(), m.offset()): m for m in read_all(bootstrap, topics.staged_routes)}
    assert len(chunks) == kinds.count("chunk") > 0
    checked = 0
    for message in read_all(bootstrap, topics.staged_calls, expect=kinds.count("staged")):
        call = STAGED.decode(message.value())
        assert call["routed_experts"] is None and call["route_encoding"] == 1
        ref = RouteReference.from_value(call["routes_ref"], max_chunk_bytes=CHUNK_BYTES, delta_len=call["delta_len"])
        assert (ref.topic, ref.partition) == (topics.staged_routes, message.partition())
        datas = []
        for index, chunk_ref in enumerate(ref.chunks):
            chunk = chunks[(ref.partition, chunk_ref.offset)]
            assert chunk.key() == message.key()
            datas.append(check_chunk(ref, index, CHUNKS.decode(chunk.value()), group_id=call["group_id"],
                                     staging_key=call["staging_key"]))
            checked += 1
        assert len(join_chunks(ref, datas)) == ref.payload_bytes
    assert checked == len(chunks)
    return checked


def test_go_producer_reproduces_the_vectors_and_the_worked_example(go_producer):
    done = subprocess.run(
        [str(go_producer), "check", "-vectors", str(VECTORS / "gym_extended_vectors.json"),
         "-golden", str(VECTORS / "gym_golden_vectors.json"), "-doc", str(ROOT / "docs" / "producers.md")],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    # 21 extras + 5 prefix + 4 chain + 3 call digests + 4 envelopes + 2 golden
    # + 18 worked-example values + 8 keys x 3 murmur2 values
    assert result == {"checked": 84, "failures": None}


def test_go_producer_groups_are_verified_and_routes_assembled(kafka, go_producer):
    topics = unique_topics()
    cfg = direct_replay_config(kafka.bootstrap, topics)
    setup_topics(cfg, partitions=PARTITIONS)
    n = 4
    report = run_go(go_producer, kafka.bootstrap, topics, "-prefix", "gx", "-groups", "4",
                    "-group-size", str(n), "-turns", "3", "-layers", "2", "-topk", "2", "-experts", "64")
    groups = {g["group_id"]: g for g in report["groups"]}
    # franz-go's default partitioner put every record where the contract's partitioner says.
    kinds = [d["kind"] for d in report["deliveries"]]
    assert (kinds.count("staged"), kinds.count("receipt")) == (len(groups) * n * 3, len(groups) * n)
    assert report["misplaced"] == 0 and check_references(kafka.bootstrap, topics, report) >= len(groups) * n * 3 * 2
    assert all(d["partition"] == partition_for(d["key"].encode(), PARTITIONS) for d in report["deliveries"])
    assert len({d["partition"] for d in report["deliveries"]}) > 1   # the groups span partitions

    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("groups_published") >= len(groups), 90, "every Go group published")
        assert stats.total("dead_letters") == 0
    assert read_all(kafka.bootstrap, topics.dead_letter) == []
    summaries, rows = published(kafka.bootstrap, topics)
    assert set(summaries) == set(rows) == set(groups)

    repaired = 0
    for group_id, group in groups.items():
        summary, got = summaries[group_id], rows[group_id]
        assert summary["outcome"] == "complete" and summary["total_rows"] == n
        assert summary["valid_rows"] == n - 1, summary["rejections"]
        assert [r["row_index"] for r in got] == list(range(n))
        for row, rollout in zip(got, group["rollouts"]):
            assert row["rollout_id"] == rollout["rollout_id"]
            if not rollout["receipt"]:
                assert (row["valid"], row["rejection_reason"]) == (False, "missing_receipt")
                continue
            assert row["valid"] and row["rejection_reason"] is None
            assert tensor(row, "input_ids").tolist() == rollout["input_ids"]
            assert tensor(row, "token_mask").tolist() == rollout["token_mask"]
            assert tensor(row, "generation_logprobs").tolist() == rollout["logprobs"]
            routes = tensor(row, "routed_experts")
            expected = np.array(rollout["routed_experts"], dtype=np.int16)
            assert routes.dtype == np.int16 and routes.shape == expected.shape == (len(rollout["input_ids"]), 2, 2)
            assert np.array_equal(routes, expected)
            # Assembled, not a sentinel fallback: only the terminal's last token is unrouted,
            # and every turn boundary carries the child's prefill route (never -1).
            unrouted = np.flatnonzero((routes == -1).all(axis=(1, 2)))
            assert unrouted.tolist() == [len(expected) - 1]
            assert len(rollout["boundary_positions"]) == 2
            for position in rollout["boundary_positions"]:
                assert (routes[position] >= 0).all()
                repaired += 1
    assert repaired == len(groups) * (n - 1) * 2


def test_a_wrong_partitioner_and_tampered_payloads_are_caught(kafka, go_producer):
    """The same program with a CRC32 partitioner (librdkafka's default hashing) and with columns
    changed after their digests: misrouted dead letters and the documented rejections."""
    topics = unique_topics()
    cfg = direct_replay_config(kafka.bootstrap, topics)
    setup_topics(cfg, partitions=PARTITIONS)
    crc = run_go(go_producer, kafka.bootstrap, topics, "-prefix", "crc", "-groups", "6", "-group-size", "2",
                 "-turns", "2", "-partitioner", "crc32")
    boundary = run_go(go_producer, kafka.bootstrap, topics, "-prefix", "tb", "-groups", "1",
                      "-group-size", "3", "-tamper", "boundary")
    token = run_go(go_producer, kafka.bootstrap, topics, "-prefix", "tt", "-groups", "1",
                   "-group-size", "3", "-tamper", "token")
    # route chunks are not the stage's input in every mode: count the staged calls' and receipts'
    wrong = [d for d in crc["deliveries"]
             if d["kind"] != "chunk" and d["partition"] != partition_for(d["key"].encode(), PARTITIONS)]
    wrong_groups = {d["key"] for d in wrong}
    assert all(d["partition"] == zlib.crc32(d["key"].encode()) % PARTITIONS for d in crc["deliveries"])
    assert crc["misplaced"] >= len(wrong) and wrong_groups and len(wrong_groups) < 6, \
        "crc32 and murmur2 agree on all or none of these group ids: pick others"
    expected_groups = ({g["group_id"] for g in crc["groups"]} - wrong_groups) | {"tb0", "tt0"}

    with RunningStage(cfg) as stage:
        stats = stage.runtime.stats
        stage.wait(lambda: stats.total("groups_published") >= len(expected_groups)
                   and stats.total("dead_letters") >= len(wrong), 90, "publication and dead letters")
        assert stats.count("dead_letters", topic=topics.receipts, reason="misrouted") \
            + stats.count("dead_letters", topic=topics.staged_calls, reason="misrouted") == len(wrong)
    letters = [letter for letter in read_all(kafka.bootstrap, topics.dead_letter)
               if dict(letter.headers())["source-topic"].decode() != topics.staged_routes]
    assert len(letters) == len(wrong)
    for letter in letters:
        headers = dict(letter.headers())
        key = letter.key().decode()
        assert headers["error-class"] == b"misrouted" and key in wrong_groups
        assert (f"misrouted: key '{key}' belongs in partition {partition_for(key.encode(), PARTITIONS)} "
                f"of {PARTITIONS}") in headers["error"].decode()
    summaries, rows = published(kafka.bootstrap, topics)
    assert set(summaries) == expected_groups       # a group whose every record was misplaced never publishes

    for report, reason in ((boundary, "route_assembly:fragment_integrity"), (token, "invalid_staging_row:")):
        (group,) = report["groups"]
        for row, rollout in zip(rows[group["group_id"]], group["rollouts"]):
            if rollout.get("tampered"):
                assert not row["valid"] and row["rejection_reason"].startswith(reason), row["rejection_reason"]
            elif not rollout["receipt"]:
                assert row["rejection_reason"] == "missing_receipt"
            else:
                assert row["valid"] and tensor(row, "input_ids").tolist() == rollout["input_ids"]
    (tampered_token,) = [r for r in rows["tt0"] if not r["valid"] and r["rejection_reason"] != "missing_receipt"]
    assert "digest does not match staged call contents" in tampered_token["rejection_reason"]
