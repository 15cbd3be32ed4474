"""Resume on a real broker and a running stage: a rollout resumed (twice) after its worker died
is published VALID with the rows of an uninterrupted run; a group published while its owner was
down is refused; a conflicting copy in the chain is judged as the stage judges it; every refusal
is a result naming its reason."""

from __future__ import annotations

import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.client import BrokerUnreachable, ReceiptEmitter, RolloutResumer, RolloutStager, StagingProducer
from stage.client import resume as r
from stage.finalize import GroupFinalizer, InMemoryTokenSource, ReassemblyConfig
from stage.publish.records import row_record
from stage.wire import AvroCodec
from stage.wire.partitioner import partition_for
from tests.integration.harness import RunningStage, read_all, rows_by_group, setup_topics, stage_config, unique_topics

L, K = 2, 2
DIRECT = ReassemblyConfig(router_replay=True, defer_routes=False, route_layers=L, route_topk=K)
ROWS = AvroCodec("CanonicalRow")
SUMMARY = AvroCodec("GroupSummary")


def _inputs(seed: int, turns: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for t in range(turns):
        carry, gen = (6 if t == 0 else 3), 4
        out.append(dict(prompt_delta=rng.integers(1, 999, carry), generated=rng.integers(1, 999, gen),
                        generated_logprobs=-rng.random(gen).astype(np.float32), weight_version=3 + t,
                        routed_experts=rng.integers(0, 60, (carry + gen, L, K)),
                        routed_experts_boundary=None if t == 0 else rng.integers(0, 60, (1, L, K))))
    return out


def _stage(stager, inputs, start=0, stop=None) -> None:
    for t in range(start, len(inputs) if stop is None else stop):
        stager.stage(f"c{t}", parent_call_id=f"c{t - 1}" if t else None, **inputs[t])


def _expected(group_id: str, inputs_by_rollout: list[list[dict]], rewards) -> list[dict]:
    """The rows of an uninterrupted run, computed by the library from the same calls."""
    source, receipts = InMemoryTokenSource(), []
    for i, inputs in enumerate(inputs_by_rollout):
        stager = RolloutStager(None, group_id, f"{group_id}-r{i}")
        for t, kwargs in enumerate(inputs):
            source.stage(stager.prepare(f"c{t}", parent_call_id=f"c{t - 1}" if t else None, **kwargs).record)
        receipts.append(stager.receipt().to_json())
    n = len(receipts)
    group = GroupFinalizer(source, DIRECT).finalize_group(
        group_id, [f"{group_id}-r{i}" for i in range(n)], receipts, rewards, mask_sample=[False] * n,
        fallback_weight_version=0, prompt_idx=0)
    return [row_record(row) for row in group.rows]


def _setup(kafka, **overrides):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, finalize=DIRECT, **overrides)
    setup_topics(cfg, partitions=2)
    return cfg, topics


def _same_partition(prefix: str, other: str, n: int = 2) -> str:
    """A group id in ``other``'s partition (so one partition holds both groups' records)."""
    target = partition_for(other.encode(), n)
    return next(f"{prefix}{i}" for i in range(1000) if partition_for(f"{prefix}{i}".encode(), n) == target)


def _count(kafka, topic: str, key: str) -> int:
    return sum(1 for m in read_all(kafka.bootstrap, topic) if m.key() == key.encode())


def test_a_rollout_resumed_twice_publishes_valid_rows_identical_to_an_uninterrupted_run(kafka):
    cfg, topics = _setup(kafka, group_timeout_ms=120_000)
    early, group = "early", _same_partition("res", "early")
    inputs = [_inputs(1), _inputs(2)]
    with RunningStage(cfg) as stage, StagingProducer(kafka.bootstrap, topics=topics) as producer:
        # a group published before: the stage's committed offset moves past its records
        done = [RolloutStager(producer, early, f"{early}-r{i}") for i in range(2)]
        emitter = ReceiptEmitter(producer, group_id=early, group_size=2, prompt_idx=0)
        for i, stager in enumerate(done):
            _stage(stager, _inputs(10 + i))
            emitter.emit(i, stager.receipt(), reward=1.0)
        producer.flush()
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "early published")

        emitter = ReceiptEmitter(producer, group_id=group, group_size=2, prompt_idx=0)
        whole = RolloutStager(producer, group, f"{group}-r1")
        _stage(whole, inputs[1])
        emitter.emit(1, whole.receipt(), reward=0.0)
        _stage(RolloutStager(producer, group, f"{group}-r0"), inputs[0], stop=1)   # then the worker dies
        producer.flush()

        with RolloutResumer(kafka.bootstrap, stage_group_id=cfg.group_id, topics=topics) as resumer:
            first, finished = resumer.resume_all([(group, f"{group}-r0"), (group, f"{group}-r1")],
                                                 producer=producer)
            staged_partition = (topics.staged_calls, partition_for(group.encode(), 2))
            assert resumer.starts[staged_partition] >= 2 * 3    # from the committed offset: past `early`
        assert finished.outcome == r.RECEIPT_EMITTED
        assert first.resumed and first.last_call_id == "c0" and first.call_ids == ("c0",)
        assert first.weight_versions == (3,) and first.tokens_reused == 10
        assert np.array_equal(first.token_ids, np.concatenate([inputs[0][0]["prompt_delta"],
                                                               inputs[0][0]["generated"]]))
        _stage(first.stager, inputs[0], start=1, stop=2)          # resumed, then dies again
        producer.flush()

        with RolloutResumer(kafka.bootstrap, stage_group_id=cfg.group_id, topics=topics) as resumer:
            second = resumer.resume(group, f"{group}-r0", producer=producer)
        assert second.resumed and second.call_ids == ("c0", "c1") and second.weight_versions == (3, 4)
        assert second.tokens_reused == 10 + 7
        _stage(second.stager, inputs[0], start=2)
        emitter.emit(0, second.stager.receipt(), reward=1.0)
        producer.flush()
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 2, 60, "group published")

    summaries = [SUMMARY.decode(m.value()) for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    assert [(s["group_id"], s["outcome"], s["valid_rows"]) for s in summaries] == \
        [(early, "complete", 2), (group, "complete", 2)]
    rows = rows_by_group([ROWS.decode(m.value()) for m in read_all(kafka.bootstrap, topics.canonical_rows)])
    assert rows[group] == _expected(group, inputs, [1.0, 0.0])
    # nothing was staged twice: 3 calls per rollout, and as many route chunks as calls
    assert _count(kafka, topics.staged_calls, group) == 6
    assert _count(kafka, topics.staged_routes, group) == 6


def test_a_group_published_while_its_owner_was_down_is_refused(kafka):
    cfg, topics = _setup(kafka, group_timeout_ms=2_000)
    group = "pub"
    with RunningStage(cfg) as stage, StagingProducer(kafka.bootstrap, topics=topics) as producer:
        _stage(RolloutStager(producer, group, f"{group}-r0"), _inputs(1), stop=2)   # its worker dies
        whole = RolloutStager(producer, group, f"{group}-r1")
        _stage(whole, _inputs(2))
        ReceiptEmitter(producer, group_id=group, group_size=2, prompt_idx=0).emit(1, whole.receipt(), reward=1.0)
        producer.flush()
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "published at deadline")
        with RolloutResumer(kafka.bootstrap, stage_group_id=cfg.group_id, topics=topics) as resumer:
            result = resumer.resume(group, f"{group}-r0", producer=producer)
    assert result.outcome == r.PUBLISHED and not result.resumed and result.stager is None
    assert "deadline" in result.reason


def test_a_conflicting_copy_in_the_chain_is_judged_as_the_stage_judges_it(kafka):
    cfg, topics = _setup(kafka, group_timeout_ms=120_000)
    group, inputs = "conf", [_inputs(3), _inputs(4)]
    with RunningStage(cfg) as stage, StagingProducer(kafka.bootstrap, topics=topics) as producer:
        _stage(RolloutStager(producer, group, f"{group}-r0"), inputs[0], stop=2)
        twin = RolloutStager(None, group, f"{group}-r0")     # a replayed worker, other tokens for c1
        twin.prepare("c0", **inputs[0][0])                   # (its c0 not sent again)
        twin.producer = producer
        twin.stage("c1", parent_call_id="c0", **_inputs(99)[1])
        whole = RolloutStager(producer, group, f"{group}-r1")
        _stage(whole, inputs[1])
        emitter = ReceiptEmitter(producer, group_id=group, group_size=2, prompt_idx=0)
        emitter.emit(1, whole.receipt(), reward=1.0)
        producer.flush()
        with RolloutResumer(kafka.bootstrap, stage_group_id=cfg.group_id, topics=topics) as resumer:
            result = resumer.resume(group, f"{group}-r0", producer=producer)
        assert result.resumed and result.call_ids == ("c0", "c1") and not result.dropped
        assert len(result.conflicts) == 1 and "c1" in result.conflicts[0]     # the first copy kept
        _stage(result.stager, inputs[0], start=2)
        emitter.emit(0, result.stager.receipt(), reward=0.0)
        producer.flush()
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "group published")
    rows = rows_by_group([ROWS.decode(m.value()) for m in read_all(kafka.bootstrap, topics.canonical_rows)])
    assert rows[group] == _expected(group, inputs, [0.0, 1.0])
    dead = read_all(kafka.bootstrap, topics.dead_letter)
    assert len(dead) == 1 and any(b"staged twice" in (v or b"") for _k, v in dead[0].headers() or [])


def _commit(kafka, group_id: str, offsets: list[TopicPartition]) -> None:
    """Offsets committed as the stage's consumer group would have (no stage runs here)."""
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": group_id, "enable.auto.commit": False})
    consumer.commit(offsets=offsets, asynchronous=False)
    consumer.close()


def test_each_refusal_is_a_result_with_its_reason(kafka):
    cfg, topics = _setup(kafka)
    with StagingProducer(kafka.bootstrap, topics=topics) as producer:
        _stage(RolloutStager(producer, "ok", "ok-r0"), _inputs(1), stop=2)
        done = RolloutStager(producer, "full", "full-r0")
        _stage(done, _inputs(2))
        emitter = ReceiptEmitter(producer, group_id="full", group_size=2, prompt_idx=0)
        emitter.emit(0, done.receipt(), reward=1.0)
        emitter.emit_missing(1, rollout_id="full-r1")
        broken = RolloutStager(None, "broken", "broken-r0").prepare("c0", **_inputs(3)[0]).value
        ids = broken["token_ids_delta"]
        tokens = np.frombuffer(ids["data"], dtype=ids["dtype"]).copy()
        tokens[0] += 1
        producer.send_staged("broken", {**broken, "token_ids_delta": {**ids, "data": tokens.tobytes()}})
    with RolloutResumer(kafka.bootstrap, stage_group_id=cfg.group_id, topics=topics) as resumer:
        ok, stale, missing, complete, emitted, chain = resumer.resume_all(
            [("ok", "ok-r0"), ("ok", "ok-r0"), ("ok", "ok-r9"), ("full", "full-r2"), ("full", "full-r0"),
             ("broken", "broken-r0")])
        assert ok.resumed and ok.call_ids == ("c0", "c1")   # no committed offset yet: from the log start
        assert missing.outcome == r.NOTHING_STAGED
        assert (complete.outcome, emitted.outcome) == (r.GROUP_COMPLETE, r.RECEIPT_EMITTED)
        assert chain.outcome == r.CHAIN_BROKEN and "digest" in chain.reason
        [stale] = resumer.resume_all([("ok", "ok-r0")], max_weight_version_lag=2, current_weight_version=6)
        assert stale.outcome == r.STALE and "3..4" in stale.reason
        assert resumer.resume("ok", "ok-r0", max_weight_version_lag=2, current_weight_version=5).resumed
        late = resumer.resume("ok", "ok-r0", group_timeout_ms=60_000, now_ms=ok_now(kafka, topics) + 60_000)
        assert late.outcome == r.DEADLINE_PASSED
        assert resumer.resume("ok", "ok-r0", group_timeout_ms=60_000).resumed
    # the stage committed past the log start of a partition (retention deleted its records)
    partition = partition_for(b"ok", 2)
    _commit(kafka, cfg.group_id, [TopicPartition(topics.staged_calls, partition, 0)])
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    for future in admin.delete_records([TopicPartition(topics.staged_calls, partition, 1)]).values():
        future.result(30)
    with RolloutResumer(kafka.bootstrap, stage_group_id=cfg.group_id, topics=topics) as resumer:
        gone = resumer.resume("ok", "ok-r0")
    assert gone.outcome == r.PAST_RETENTION and "below the log start 1" in gone.reason
    with pytest.raises(BrokerUnreachable):
        RolloutResumer("127.0.0.1:1", topics=topics, connect_timeout=1)


def ok_now(kafka, topics) -> int:
    """The Kafka timestamp of group ``ok``'s first staged call."""
    return min(m.timestamp()[1] for m in read_all(kafka.bootstrap, topics.staged_calls) if m.key() == b"ok")
