"""The producer SDK: Gym-compatible digests (checked against the contract), route extras and
boundary indices, receipts and receipt events, delivery errors surfaced, the Gym bridge."""

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

L, K = 3, 2
RNG = np.random.default_rng(11)
ROOT = dict(prompt_delta=[5, 6, 7], generated=[8, 9], generated_logprobs=[-0.5, -0.25], weight_version=4)
CHILD = dict(prompt_delta=[10], generated=[11, 12, 13], generated_logprobs=[-1.0, -0.125, -2.0],
             weight_version=5)
ROOT_ROUTES = RNG.integers(0, 64, (5, L, K))
CHILD_ROUTES = RNG.integers(0, 64, (4, L, K))
BOUNDARY = RNG.integers(0, 64, (1, L, K))


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
    for msg, prepared in zip(fake.records[:2], (root, child)):
        want = staged_codec.decode(staged_codec.encode(staged_call_from_record("grp", prepared.record)))
        assert staged_codec.decode(msg.value()) == want
    published = receipt_codec.decode(fake.records[2].value())
    assert RolloutReceipt.from_json(published["receipt"]) == RolloutReceipt.from_json(receipt_json)
    assert event["rollout_id"] == "r0" and published["canonical_sample_id"] == "grp_g0"
    # a record Gym's rules refuse is refused here, before anything is produced
    broken = root.record.to_json()
    broken["digest"] = "0" * 64
    with pytest.raises(WireValidationError, match="digest does not match"):
        bridge.publish_staged_record("grp", broken)
    assert len(fake.records) == 3
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
