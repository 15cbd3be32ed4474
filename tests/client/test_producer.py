"""The producer SDK: Gym-compatible digests (checked against the contract), route extras and
boundary indices, receipts and receipt events, delivery errors surfaced, the Gym bridge."""

import re

import numpy as np
import pytest
import torch
from confluent_kafka import KafkaError

from stage.client import (
    DeliveryError,
    GymBridge,
    ReceiptEmitter,
    RolloutStager,
    StagingProducer,
    staged_call_from_record,
)
from stage.contract import (
    RolloutReceipt,
    WireValidationError,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    encode_routed_experts,
    hash_token_ids,
    verify_and_linearize,
)
from stage.contract.producer import RolloutBuilder
from stage.decode import staged_row
from stage.finalize import StagedMedia, TopK
from stage.routes import (
    ROUTED_EXPERTS_BOUNDARY_FIELD,
    ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD,
    ROUTED_EXPERTS_FIELD,
    verify_route_fragment_integrity,
)
from stage.wire import AvroCodec, TopicNames
from tests.client.fakes import FakeProducer

CHUNKS = AvroCodec("RouteChunk")
L, K = 3, 2
RNG = np.random.default_rng(11)
ROOT = dict(prompt_delta=[5, 6, 7], generated=[8, 9], generated_logprobs=[-0.5, -0.25], weight_version=4)
CHILD = dict(prompt_delta=[10], generated=[11, 12, 13], generated_logprobs=[-1.0, -0.125, -2.0],
             weight_version=5)
ROOT_ROUTES = RNG.integers(0, 64, (5, L, K))
CHILD_ROUTES = RNG.integers(0, 64, (4, L, K))
BOUNDARY = RNG.integers(0, 64, (1, L, K))


def inline(call: dict, records) -> dict:
    """A StagedCall value staged by reference with its routes put back inline from the route
    chunks among ``records`` (FakeProducer messages: offset = position), as the stage reads it."""
    ref = call["routes_ref"]
    assert call["routed_experts"] is None and ref is not None
    chunks = [CHUNKS.decode(records[c["offset"]].value()) for c in ref["chunks"]]
    assert all(records[c["offset"]].topic() == ref["topic"] for c in ref["chunks"])
    data = b"".join(c["data"] for c in chunks)
    return {**call, "routes_ref": None,
            "routed_experts": {"dtype": ref["dtype"], "shape": ref["shape"], "data": data}}


def sdk_rollout(producer=None, group_id="grp"):
    stager = RolloutStager(producer, group_id, "r0")
    root = stager.prepare("c0", routed_experts=ROOT_ROUTES, **ROOT)
    child = stager.prepare("c1", parent_call_id="c0", routed_experts=CHILD_ROUTES,
                           routed_experts_boundary=BOUNDARY, extras={"turn": 2}, **CHILD)
    return stager, root, child


def test_staged_call_digests_equal_the_contracts_independent_computation():
    _, root, child = sdk_rollout()
    full_root = np.array([5, 6, 7, 8, 9], dtype=np.uint64)
    delta = np.array([10, 11, 12, 13], dtype=np.uint64)
    # extras as Gym's worker commits them: nrlre1 envelopes, the boundary index is the parent's
    # last token (cum_len 5 -> index 4), user metadata kept
    extras = {"turn": 2, ROUTED_EXPERTS_FIELD: encode_routed_experts(CHILD_ROUTES, "int16"),
              ROUTED_EXPERTS_BOUNDARY_FIELD: encode_routed_experts(BOUNDARY, "int16"),
              ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD: 4}
    record = child.record
    assert record.extras == extras
    assert record.extras_digest == compute_extras_digest(extras)
    assert record.chain_hash == compute_chain_hash(root.record.chain_hash, delta)
    assert root.record.chain_hash == compute_chain_hash(None, full_root)
    assert record.cumulative_hash == hash_token_ids(np.concatenate([full_root, delta]))
    assert (record.prev_len, record.delta_len, record.cum_len, record.mode) == (5, 4, 9, "token_in")
    assert record.digest == compute_staging_digest(**record.digest_fields())
    # and the coordinates returned are the CallRecord Gym's RolloutBuilder makes for the same call
    builder = RolloutBuilder("r0")
    builder.stage("c0", parent_call_id=None, extras={ROUTED_EXPERTS_FIELD: encode_routed_experts(ROOT_ROUTES)},
                  prompt_delta=ROOT["prompt_delta"], generated=ROOT["generated"],
                  generated_logprobs=ROOT["generated_logprobs"], weight_version=4)
    expected = builder.stage("c1", parent_call_id="c0", extras=extras, prompt_delta=[10], generated=[11, 12, 13],
                             generated_logprobs=CHILD["generated_logprobs"], weight_version=5)
    assert child.manifest_row == expected.manifest_row
    assert child.manifest_row.staging_key == "r0/c1"


def test_what_the_sdk_puts_on_the_wire_verifies_and_carries_intact_route_fragments():
    stager, root, child = sdk_rollout()
    codec = AvroCodec("StagedCall")
    rows = [staged_row(codec.decode(codec.encode(p.value))) for p in (root, child)]
    assert [p.value["group_id"] for p in (root, child)] == ["grp", "grp"]
    receipt = stager.receipt()  # terminal defaults to the last staged call
    assert receipt.terminal_model_call_id == "c1" and receipt.terminal_selection == "declared"
    row = verify_and_linearize(receipt, [r.snapshot for r in rows])
    assert row.token_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert row.token_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 1]
    for staged, manifest_row in zip(rows, receipt.manifest):
        assert verify_route_fragment_integrity(manifest_row, staged.fragment())
    assert torch.equal(rows[1].fragment().boundary_routes, torch.tensor(BOUNDARY, dtype=torch.int16))


def test_receipt_variants_follow_gyms_rules():
    stager, _, _ = sdk_rollout()
    poisoned = stager.receipt("c1", capture_poisoned=True)
    assert poisoned.capture_poisoned and poisoned.failure_reason is None
    failed = stager.receipt("c1", failure_reason="tool crashed")
    assert failed.capture_poisoned and failed.failure_reason == "tool crashed"
    assert [r.model_call_id for r in stager.receipt("c0", order=["c1", "c0"]).manifest] == ["c1", "c0"]


def test_boundary_route_needs_a_parent_and_routes_need_their_delta_length():
    stager = RolloutStager(None, "grp", "r0")
    with pytest.raises(ValueError, match="child call"):
        stager.prepare("c0", routed_experts=ROOT_ROUTES, routed_experts_boundary=BOUNDARY, **ROOT)
    with pytest.raises(ValueError, match="delta-aligned"):
        stager.prepare("c0", routed_experts=ROOT_ROUTES[:4], **ROOT)
    with pytest.raises(RuntimeError, match="prepare"):
        stager.stage("c0", **ROOT)


def test_media_and_topk_travel_beside_the_digested_extras():
    stager = RolloutStager(None, "grp", "r0")
    media = StagedMedia(imgs=np.ones((1, 2, 12), np.float32), imgs_sizes=np.array([[2, 4]], np.int32))
    topk = TopK(ids=np.arange(4, dtype=np.int32).reshape(2, 2), logprobs=-np.ones((2, 2), np.float32))
    prepared = stager.prepare("c0", media=media, topk=topk, **ROOT)
    plain = RolloutStager(None, "grp", "r0").prepare("c0", **ROOT)
    assert prepared.manifest_row == plain.manifest_row  # media and top-k are not digested
    row = staged_row(AvroCodec("StagedCall").decode(AvroCodec("StagedCall").encode(prepared.value)))
    assert row.media.imgs.tolist() == media.imgs.tolist() and row.topk.ids.tolist() == topk.ids.tolist()


def test_stage_and_emit_produce_keyed_records_and_collect_acknowledgements():
    fake = FakeProducer()
    seen = []
    producer = StagingProducer(producer=fake, topics=TopicNames(receipts="r", staged_calls="s"),
                               on_delivery=seen.append)
    stager = RolloutStager(producer, "g7", "g7-r0")
    row = stager.stage("c0", **ROOT)
    emitter = ReceiptEmitter(producer, group_id="g7", group_size=2, prompt_idx=3, fallback_weight_version=9)
    sent = emitter.emit(0, stager.receipt(), reward=0.5)
    missing = emitter.emit_missing(1, rollout_id="g7-r1")
    producer.flush()
    assert [(m.topic(), m.key()) for m in fake.records] == [("s", b"g7"), ("r", b"g7"), ("r", b"g7")]
    assert (producer.produced, producer.delivered) == (3, 3)
    assert [(d.topic, d.partition, d.offset, d.error) for d in seen] == [("s", 0, 0, None), ("r", 0, 1, None),
                                                                           ("r", 0, 2, None)]
    decoded = AvroCodec("ReceiptEvent").decode(fake.records[1].value())
    assert decoded == AvroCodec("ReceiptEvent").decode(AvroCodec("ReceiptEvent").encode(sent))
    assert decoded["receipt"]["manifest"][0]["digest"] == row.digest
    assert (decoded["canonical_sample_id"], decoded["fallback_weight_version"], decoded["group_size"]) == \
        ("g7_g0", 9, 2)
    assert missing["receipt"] is None and missing["rollout_id"] == "g7-r1" and missing["rollout_index"] == 1
    with pytest.raises(ValueError, match="rollout_index"):
        emitter.event(2, None, reward=0.0, rollout_id="x")
    with pytest.raises(ValueError, match="rollout_id"):
        emitter.event(0, None, reward=0.0)


def test_delivery_failures_are_raised_by_flush_not_swallowed():
    producer = StagingProducer(producer=FakeProducer(fail_with=KafkaError._MSG_TIMED_OUT))
    RolloutStager(producer, "g", "r").stage("c0", **ROOT)
    with pytest.raises(DeliveryError) as raised:
        producer.flush()
    (failure,) = raised.value.failures
    assert failure.topic == TopicNames().staged_calls and failure.key == b"g"
    assert "timed out" in failure.error.lower()
    producer.flush()  # reported once, then forgotten


def test_a_real_client_reports_an_unreachable_broker_as_a_delivery_error():
    producer = StagingProducer("127.0.0.1:9", config={"message.timeout.ms": 500, "enable.idempotence": False},
                               connect_timeout=None)     # no first-contact check (stage.client.connection)
    RolloutStager(producer, "g", "r").stage("c0", **ROOT)
    with pytest.raises(DeliveryError, match="1 record"):
        producer.flush(30)


def test_an_oversize_record_fails_at_produce_with_a_clear_error():
    producer = StagingProducer("127.0.0.1:9", config={"message.max.bytes": 1000})
    with pytest.raises(DeliveryError, match="(?i)too large"):
        producer.produce("t", "g", b"x" * 5000)


def test_gym_bridge_publishes_gyms_json_unchanged_in_meaning():
    fake = FakeProducer()
    bridge = GymBridge(StagingProducer(producer=fake))
    stager, root, child = sdk_rollout()
    receipt_json = stager.receipt().to_json()
    keys = [bridge.publish_staged_record("grp", p.record.to_json_text()) for p in (root, child)]
    event = bridge.publish_receipt("grp", receipt_json, rollout_index=0, group_size=1, prompt_idx=4,
                                   reward=1.0)
    bridge.producer.flush()
    assert keys == ["r0/c0", "r0/c1"]
    staged_codec, receipt_codec = AvroCodec("StagedCall"), AvroCodec("ReceiptEvent")
    topics = TopicNames()
    staged = [m for m in fake.records if m.topic() == topics.staged_calls]
    assert len(staged) == 2 and len(fake.records) == 5      # each call: one route chunk, then the call
    for msg, prepared in zip(staged, (root, child)):
        want = staged_codec.decode(staged_codec.encode(staged_call_from_record("grp", prepared.record)))
        assert inline(staged_codec.decode(msg.value()), fake.records) == want
    published = receipt_codec.decode(fake.records[-1].value())
    assert RolloutReceipt.from_json(published["receipt"]) == RolloutReceipt.from_json(receipt_json)
    assert event["rollout_id"] == "r0" and published["canonical_sample_id"] == "grp_g0"
    # a record Gym's rules refuse is refused here, before anything is produced
    broken = root.record.to_json()
    broken["digest"] = "0" * 64
    with pytest.raises(WireValidationError, match="digest does not match"):
        bridge.publish_staged_record("grp", broken)
    assert len(fake.records) == 5
    missing = bridge.publish_receipt("grp", None, rollout_id="r9", rollout_index=0, group_size=1,
                                     prompt_idx=4)
    assert missing["receipt"] is None and missing["reward"] == 0.0


def test_staging_routes_writes_no_base64_and_sends_what_the_gym_record_says(monkeypatch):
    """Routes are digested as envelope parts: no envelope string is built or decoded to stage a
    call, and the wire value is exactly the one the full Gym record gives."""
    from stage.contract import RouteEnvelope, StagedCallRecord
    rng = np.random.default_rng(3)
    built = []
    real_text = RouteEnvelope.text
    monkeypatch.setattr(RouteEnvelope, "text", lambda self: built.append(self) or real_text(self))
    stager = RolloutStager(None, "g", "r")
    calls = []
    for i, dtype in enumerate(("int8", "int16", "int32")):
        n = 5 + i
        calls.append(stager.prepare(
            f"c{i}", parent_call_id=f"c{i - 1}" if i else None, prompt_delta=rng.integers(0, 99, 3),
            generated=rng.integers(0, 99, n - 3), generated_logprobs=-rng.random(n - 3), weight_version=2,
            routed_experts=rng.integers(-1, 120, (n, 4, 2)), route_dtype=dtype,
            routed_experts_boundary=rng.integers(0, 120, (1, 4, 2)) if i else None,
            extras={"note": "x", "score": 1.5}))
    assert built == []                                   # staged without a single envelope string
    codec = AvroCodec("StagedCall")
    for prepared in calls:
        record = prepared.record                         # Gym's record, strings written out now
        assert StagedCallRecord(**record.to_json()).extras == record.extras   # passes Gym's rules
        want = staged_call_from_record("g", record)
        assert codec.decode(codec.encode(prepared.value)) == codec.decode(codec.encode(want))
    assert len(built) == 5                               # three fragments, two boundaries


def test_a_fragment_that_is_not_delta_aligned_is_refused_as_before():
    stager = RolloutStager(None, "g", "r")
    with pytest.raises(ValueError, match="must already be delta-aligned"):
        stager.prepare("c0", prompt_delta=[1, 2], generated=[3], generated_logprobs=[-0.5],
                       weight_version=0, routed_experts=np.zeros((4, 2, 2), np.int8), route_dtype="int8")
    with pytest.raises(ValueError, match="do not fit dtype 'int8'"):
        stager.prepare("c1", prompt_delta=[1, 2], generated=[3], generated_logprobs=[-0.5],
                       weight_version=0, routed_experts=np.full((3, 2, 2), 300), route_dtype="int8")


# -- routes by reference (claim-check) ---------------------------------------------------------

T, RL, RK = 40, 6, 4          # 40 x 6 x 4 int16 routes: 1,920 bytes, two chunks of at most 1,000


class PlacingProducer(FakeProducer):
    """FakeProducer whose records land in ``place(topic, nth record of that topic)``, and whose
    queue is full for the first ``full`` produces to ``full_topic``."""

    def __init__(self, place=lambda topic, n: 0, full_topic=None, full=0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.place, self.full_topic, self.full, self.counts = place, full_topic, full, {}

    def produce(self, topic, key=None, value=None, headers=None, on_delivery=None):
        if topic == self.full_topic and self.full:
            self.full -= 1
            raise BufferError("Local: Queue full")
        n = self.counts[topic] = self.counts.get(topic, -1) + 1
        super().produce(topic, key, value, headers, on_delivery)
        self.records[-1].partition = lambda p=self.place(topic, n): p


def routed_calls(stager, dtype="int16", rng=None):
    """A root and a child with routes (the child with a boundary): the prepared calls' kwargs."""
    rng = rng or np.random.default_rng(5)
    root = dict(prompt_delta=rng.integers(0, 999, 30), generated=rng.integers(0, 999, 10),
                generated_logprobs=-rng.random(10), weight_version=1, route_dtype=dtype,
                routed_experts=rng.integers(-1, 100, (T, RL, RK)))
    child = dict(prompt_delta=rng.integers(0, 999, 25), generated=rng.integers(0, 999, 15),
                 generated_logprobs=-rng.random(15), weight_version=1, route_dtype=dtype,
                 routed_experts=rng.integers(-1, 100, (T, RL, RK)),
                 routed_experts_boundary=rng.integers(0, 100, (1, RL, RK)), extras={"turn": 2})
    return root, child


def test_routes_go_by_reference_chunks_first_then_the_call_that_names_them():
    import hashlib
    fake, seen = FakeProducer(), []
    producer = StagingProducer(producer=fake, on_delivery=seen.append, route_chunk_bytes=1000)
    stager = RolloutStager(producer, "g1", "g1-r0")
    root, child = routed_calls(stager)
    rows = [stager.stage("c0", **root), stager.stage("c1", parent_call_id="c0", **child)]
    producer.flush()
    topics, codec = TopicNames(), AvroCodec("StagedCall")
    assert [m.topic() for m in fake.records] == [topics.staged_routes] * 2 + [topics.staged_calls] \
        + [topics.staged_routes] * 2 + [topics.staged_calls]
    assert [d.topic for d in seen] == [m.topic() for m in fake.records]   # each call acknowledged after its chunks
    assert all(m.key() == b"g1" for m in fake.records) and producer.deferred == 0
    for at, kwargs, row in ((2, root, rows[0]), (5, child, rows[1])):
        call = codec.decode(fake.records[at].value())
        raw = np.asarray(kwargs["routed_experts"]).astype("<i2").tobytes()
        ref = call["routes_ref"]
        assert call["routed_experts"] is None and call["route_encoding"] == 1
        assert (ref["topic"], ref["partition"], ref["dtype"], ref["shape"]) == \
            (topics.staged_routes, 0, "int16", [T, RL, RK])
        assert ref["chunks"] == [{"offset": at - 2, "length": 1000, "sha256": hashlib.sha256(raw[:1000]).hexdigest()},
                                 {"offset": at - 1, "length": 920, "sha256": hashlib.sha256(raw[1000:]).hexdigest()}]
        chunks = [CHUNKS.decode(fake.records[c["offset"]].value()) for c in ref["chunks"]]
        assert [(c["group_id"], c["staging_key"], c["index"], c["count"], c["sha256"]) for c in chunks] == \
            [("g1", row.staging_key, i, 2, r["sha256"]) for i, r in enumerate(ref["chunks"])]
        assert b"".join(c["data"] for c in chunks) == raw
        assert call["extras_digest"] == row.extras_digest       # the Gym digest over the whole routes
    boundary = codec.decode(fake.records[5].value())["routed_experts_boundary"]
    assert boundary["shape"] == [1, RL, RK] and boundary["data"] == \
        np.asarray(child["routed_experts_boundary"]).astype("<i2").tobytes()   # the boundary stays inline

    # the same calls staged inline: the same manifest rows, and the same record once the routes are put back
    old = FakeProducer()
    old_producer = StagingProducer(producer=old, routes_by_reference=False)
    old_stager = RolloutStager(old_producer, "g1", "g1-r0")
    old_rows = [old_stager.stage("c0", **root), old_stager.stage("c1", parent_call_id="c0", **child)]
    old_producer.flush()
    assert old_rows == rows
    assert [m.topic() for m in old.records] == [topics.staged_calls] * 2        # no route chunks at all
    for new_msg, old_msg in zip((fake.records[2], fake.records[5]), old.records):
        old_call = codec.decode(old_msg.value())
        assert old_call["routes_ref"] is None and old_call["routed_experts"]["shape"] == [T, RL, RK]
        assert codec.encode(inline(codec.decode(new_msg.value()), fake.records)) == old_msg.value()
    assert verify_and_linearize(stager.receipt(), [
        staged_row(codec.decode(m.value())).snapshot for m in old.records]).token_ids.size == 80


def test_a_failed_chunk_leaves_no_staged_call_and_flush_names_it():
    fake = FakeProducer(fail_with=KafkaError.MSG_SIZE_TOO_LARGE)
    producer = StagingProducer(producer=fake, route_chunk_bytes=1000)
    stager = RolloutStager(producer, "g", "r")
    stager.stage("c0", **routed_calls(stager)[0])
    with pytest.raises(DeliveryError) as raised:
        producer.flush()
    topics = TopicNames()
    assert [m.topic() for m in fake.records] == [topics.staged_routes] * 2        # never the StagedCall
    failures = raised.value.failures
    assert [f.topic for f in failures] == [topics.staged_routes] * 2 + [topics.staged_calls]
    assert failures[2].error.startswith(f"StagedCall r/c0 not produced: route chunk(s) 0, 1 of 2 to "
                                        f"{topics.staged_routes} not delivered (")
    assert failures[2].not_produced and not failures[0].not_produced
    assert "StagedCall r/c0 not produced" in str(raised.value) and producer.deferred == 0


def test_chunks_split_across_partitions_or_away_from_their_call_are_errors():
    topics = TopicNames()
    for place, words in ((lambda topic, n: n % 2, "landed in partitions [0, 1]"),
                         (lambda topic, n: int(topic == topics.staged_calls), "must have the same partition count")):
        fake = PlacingProducer(place)
        producer = StagingProducer(producer=fake, route_chunk_bytes=1000)
        stager = RolloutStager(producer, "g", "r")
        stager.stage("c0", **routed_calls(stager)[0])
        with pytest.raises(DeliveryError, match=re.escape(words)):
            producer.flush()
        assert producer.deferred == 0


def test_a_full_queue_in_the_last_chunks_callback_defers_the_call_to_the_next_poll_or_flush():
    topics = TopicNames()
    fake = PlacingProducer(full_topic=topics.staged_calls, full=1)
    producer = StagingProducer(producer=fake, route_chunk_bytes=1000)
    stager = RolloutStager(producer, "g", "r")
    stager.stage("c0", **routed_calls(stager)[0])
    assert [m.topic() for m in fake.records] == [topics.staged_routes] * 2 and producer.deferred == 1
    producer.flush()
    assert [m.topic() for m in fake.records] == [topics.staged_routes] * 2 + [topics.staged_calls]
    assert producer.deferred == 0 and producer.delivered == 3


def test_route_chunk_size_must_fit_the_record_cap():
    with pytest.raises(ValueError, match=r"route_chunk_bytes=1048576 does not fit max_record_bytes=1048576"):
        StagingProducer(producer=FakeProducer(), max_record_bytes=1 << 20, route_chunk_bytes=1 << 20)
    assert StagingProducer(producer=FakeProducer(), max_record_bytes=1 << 20).route_chunk_bytes == (1 << 20) - (64 << 10)
    from stage.staging.route_refs import DEFAULT_ROUTE_CHUNK_BYTES
    assert StagingProducer(producer=FakeProducer()).route_chunk_bytes == DEFAULT_ROUTE_CHUNK_BYTES


def test_a_call_too_large_without_its_routes_is_refused_before_anything_is_produced():
    from stage.wire import WireError
    rng = np.random.default_rng(2)
    n = 12_000                     # ~12 bytes a token: ~144 kB of token columns, over a 128 KiB cap
    kwargs = dict(prompt_delta=rng.integers(0, 999, n - 10), generated=rng.integers(0, 999, 10),
                  generated_logprobs=-rng.random(10), weight_version=1, routed_experts=np.zeros((n, 2, 2), np.int16))
    for by_reference, words in ((True, "even without its routes"), (False, "over max_record_bytes=131072")):
        fake = FakeProducer()
        producer = StagingProducer(producer=fake, max_record_bytes=128 << 10, routes_by_reference=by_reference)
        stager = RolloutStager(producer, "g", "r")
        with pytest.raises(WireError, match="max_record_bytes=131072") as raised:
            stager.stage("c0", **kwargs)
        assert words in str(raised.value)
        producer.flush()
        assert fake.records == [] and producer.deferred == 0


def test_stage_chunks_views_of_the_envelopes_bytes_and_copies_them_only_into_the_records(monkeypatch):
    from stage.client.route_staging import ChunkEncoder
    seen = []
    real = ChunkEncoder.encode
    monkeypatch.setattr(ChunkEncoder, "encode", lambda self, *a, **kw: seen.append(a[-1]) or real(self, *a, **kw))
    producer = StagingProducer(producer=FakeProducer(), route_chunk_bytes=1000)
    stager = RolloutStager(producer, "g", "r")
    root, _ = routed_calls(stager)
    stager.stage("c0", **root)
    producer.flush()
    raw = stager.builder.calls["c0"].extras[ROUTED_EXPERTS_FIELD].raw      # the digested envelope's bytes
    assert len(seen) == 2 and all(isinstance(view, memoryview) for view in seen)
    assert all(np.shares_memory(np.frombuffer(view, np.uint8), np.frombuffer(raw, np.uint8)) for view in seen)
    # prepare() still hands out bytes, as it always did
    assert type(RolloutStager(None, "g", "r").prepare("c0", **root).value["routed_experts"]["data"]) is bytes


class OffsetlessProducer(FakeProducer):
    """Acknowledges the first ``offsetless`` route chunks without an offset, as librdkafka does
    an idempotent producer's retry of a record the broker had already written (offset() None)."""

    def __init__(self, offsetless: int) -> None:
        super().__init__()
        self.offsetless = offsetless

    def produce(self, topic, key=None, value=None, headers=None, on_delivery=None):
        super().produce(topic, key, value, headers, on_delivery)
        if topic == TopicNames().staged_routes and self.offsetless:
            self.offsetless -= 1
            self.records[-1]._offset = None


def test_chunks_acknowledged_without_an_offset_are_sent_again_and_the_call_names_the_new_copies():
    topics, codec = TopicNames(), AvroCodec("StagedCall")
    fake = OffsetlessProducer(offsetless=1)
    producer = StagingProducer(producer=fake, route_chunk_bytes=1000)
    stager = RolloutStager(producer, "g", "r")
    row = stager.stage("c0", **routed_calls(stager)[0])
    producer.flush()
    assert [m.topic() for m in fake.records] == [topics.staged_routes] * 4 + [topics.staged_calls]
    call = codec.decode(fake.records[4].value())
    assert [c["offset"] for c in call["routes_ref"]["chunks"]] == [2, 3]       # the second round's
    assert [CHUNKS.decode(fake.records[i].value()) for i in (0, 1)] == \
        [CHUNKS.decode(fake.records[i].value()) for i in (2, 3)]                # the same chunks again
    assert call["extras_digest"] == row.extras_digest and producer.deferred == 0 and not producer.failures


def test_chunks_never_acknowledged_with_an_offset_fail_their_call_after_bounded_rounds():
    from stage.client.route_staging import MAX_CHUNK_ROUNDS
    topics = TopicNames()
    fake = OffsetlessProducer(offsetless=10**6)
    producer = StagingProducer(producer=fake, route_chunk_bytes=1000)
    stager = RolloutStager(producer, "g", "r")
    stager.stage("c0", **routed_calls(stager)[0])
    with pytest.raises(DeliveryError, match="acknowledged without an offset 3 time") as raised:
        producer.flush()
    assert [m.topic() for m in fake.records] == [topics.staged_routes] * 2 * MAX_CHUNK_ROUNDS   # never the call
    assert raised.value.failures[-1].not_produced and producer.deferred == 0
